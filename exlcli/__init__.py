"""exlcli: a fast local LLM engine with a terminal front end."""

__version__ = "0.1.0"
