"""Shared fixtures."""

import pytest


@pytest.fixture(scope="session")
def default_model_path() -> str:
    """The default GGUF (SmolLM2-135M-Instruct Q4_1), fetched into the user cache once."""
    from exlcli.model.registry import resolve_model_path

    return resolve_model_path(None)
