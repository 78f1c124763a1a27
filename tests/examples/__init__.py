"""Tests that run each example under ``examples/`` the way its docstring says to."""
