"""The ``reports`` app: report jobs over HTTP, each a weft_sync workflow."""
