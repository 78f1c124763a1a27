"""A handler module that fails while it is imported (``maintain --handler`` must say so)."""

raise RuntimeError("this module needs a setting that is missing")
