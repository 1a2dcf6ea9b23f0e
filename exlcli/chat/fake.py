"""A hidden model name for demos and tests: `--model fake:echo[:DELAY[:CONTEXT]]` chats with
exlcli.client.fake.FakeClient (answers "echo: <your message>", one word per token, DELAY seconds
apart, default 0.05; CONTEXT tokens of context, default 2048)."""

from __future__ import annotations

from exlcli.client.fake import FakeClient
from exlcli.errors import ExlcliError

PREFIX = "fake:"
DEFAULT_DELAY = 0.05
DEFAULT_CONTEXT = 2048


def is_fake(model: str | None) -> bool:
    return bool(model) and model.startswith(PREFIX)  # type: ignore[union-attr]


def open_fake_client(model: str) -> FakeClient:
    parts = model[len(PREFIX):].split(":")
    if parts[0] != "echo" or len(parts) > 3:
        raise ExlcliError(f"unknown fake model '{model}'; use fake:echo[:DELAY[:CONTEXT]]")
    try:
        delay = float(parts[1]) if len(parts) > 1 and parts[1] else DEFAULT_DELAY
        context = int(parts[2]) if len(parts) > 2 else DEFAULT_CONTEXT
    except ValueError:
        raise ExlcliError(f"bad fake model '{model}'; use fake:echo[:DELAY[:CONTEXT]]") from None
    if delay < 0 or context < 16:
        raise ExlcliError(f"bad fake model '{model}': DELAY must be >= 0 and CONTEXT >= 16")
    return FakeClient(context_length=context, token_delay=delay, model_name=model)
