"""Benchmarks (not tests): each script prints medians and the ratios measured in one run."""
