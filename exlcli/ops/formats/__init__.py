"""The weight-format table (see base.py): one module per format, looked up by name."""
