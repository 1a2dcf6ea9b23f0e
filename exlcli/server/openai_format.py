"""Response objects in the OpenAI API shape (plain dicts, ready for JSON)."""

from __future__ import annotations

import base64
import struct
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from exlcli.client.base import Usage
from exlcli.engine.request import TokenLogprob

TokenText = Callable[[int], str]  # token id -> its text, for logprobs


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass
class ChoiceResult:
    """One finished choice of a non-streaming answer."""

    index: int
    text: str = ""
    finish_reason: str | None = None
    stop_string: str | None = None  # the stop string that ended it, if one did
    logprobs: list[TokenLogprob] = field(default_factory=list)
    logprob_offsets: list[int] = field(default_factory=list)  # text offset of each logprob's token
    usage: Usage | None = None
    prompt_index: int = 0  # which prompt of a list `prompt` this choice answers


def usage_dict(usages: list[tuple[int, Usage | None]]) -> dict:
    """Sum the usage of several choices; `(prompt_index, usage)` pairs so that a prompt shared by
    `n` choices is counted once, as OpenAI does. Timing extras come from the first choice."""
    prompt_tokens: dict[int, int] = {}
    cached: dict[int, int] = {}
    completion = 0
    first = next((u for _, u in usages if u is not None), None)
    for prompt_index, u in usages:
        if u is None:
            continue
        prompt_tokens[prompt_index] = u.prompt_tokens
        cached[prompt_index] = u.cached_tokens
        completion += u.completion_tokens
    total_prompt = sum(prompt_tokens.values())
    body = {
        "prompt_tokens": total_prompt,
        "completion_tokens": completion,
        "total_tokens": total_prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(cached.values())},
    }
    if first is not None:  # exlcli extras, read back by RemoteClient
        body.update(queue_time=first.queue_time, ttft=first.ttft, total_time=first.total_time,
                    decode_tps=first.decode_tps)
        body["evicted_tokens"] = sum(u.evicted_tokens for _, u in usages if u is not None)  # context shifts
    return body


# ---- logprobs ---------------------------------------------------------------------------------

def _token_entry(token_id: int, token: str, logprob: float) -> dict:
    # "token_id" is an exlcli extra (OpenAI clients ignore it) so RemoteClient gets ids back.
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8", "replace")),
            "token_id": token_id}


def chat_logprobs(tokens: list[TokenLogprob], token_text: TokenText, num_top: int) -> dict:
    content = []
    for t in tokens:
        entry = _token_entry(t.token_id, token_text(t.token_id), t.logprob)
        entry["top_logprobs"] = [_token_entry(i, token_text(i), lp) for i, lp in t.top[:num_top]]
        content.append(entry)
    return {"content": content}


def completion_logprobs(tokens: list[TokenLogprob], token_text: TokenText, num_top: int,
                        offsets: list[int]) -> dict:
    """`offsets`: where each token's text starts in the choice's text (the start of the delta
    that carried it; exact when a delta holds one token, as it does while decoding).

    As OpenAI's legacy completions: `top_logprobs` holds the `num_top` best tokens and the sampled
    one (up to num_top + 1, so `logprobs: 0` gives the sampled token's). Its keys are texts, and two
    tokens may share one (a byte-level piece and its merged twin): the key keeps the more likely
    token, and the exlcli extra `top_tokens` lists every entry by id, best first."""
    tops = [_top_with_sampled(t, num_top) for t in tokens]
    return {
        "tokens": [token_text(t.token_id) for t in tokens],
        "token_logprobs": [t.logprob for t in tokens],
        "top_logprobs": [_by_text(top, token_text) for top in tops],
        "text_offset": list(offsets),
        "token_ids": [t.token_id for t in tokens],  # exlcli extra, for RemoteClient
        "top_tokens": [[_token_entry(i, token_text(i), lp) for i, lp in top] for top in tops],  # exlcli extra
    }


def _top_with_sampled(t: TokenLogprob, num_top: int) -> list[tuple[int, float]]:
    top = list(t.top[:num_top])
    if all(i != t.token_id for i, _ in top):
        top.append((t.token_id, t.logprob))
        top.sort(key=lambda e: -e[1])
    return top


def _by_text(top: list[tuple[int, float]], token_text: TokenText) -> dict[str, float]:
    out: dict[str, float] = {}
    for token_id, lp in top:  # best first: a text already there keeps its better logprob
        out.setdefault(token_text(token_id), lp)
    return out


# ---- whole answers ----------------------------------------------------------------------------

def chat_completion(response_id: str, created: int, model: str, choices: list[ChoiceResult],
                    logprob_fn: Callable[[ChoiceResult], dict | None]) -> dict:
    return {
        "id": response_id, "object": "chat.completion", "created": created, "model": model,
        "choices": [{
            "index": c.index,
            "message": {"role": "assistant", "content": c.text},
            "logprobs": logprob_fn(c),
            "finish_reason": c.finish_reason,
        } for c in choices],
        "usage": usage_dict([(c.prompt_index, c.usage) for c in choices]),
    }


def text_completion(response_id: str, created: int, model: str, choices: list[ChoiceResult],
                    logprob_fn: Callable[[ChoiceResult], dict | None]) -> dict:
    return {
        "id": response_id, "object": "text_completion", "created": created, "model": model,
        "choices": [{
            "index": c.index, "text": c.text, "logprobs": logprob_fn(c), "finish_reason": c.finish_reason,
        } for c in choices],
        "usage": usage_dict([(c.prompt_index, c.usage) for c in choices]),
    }


# ---- streaming chunks -------------------------------------------------------------------------

def _with_token_ids(choice: dict, token_ids: list[int] | None) -> dict:
    if token_ids is not None:  # exlcli extra, only when the request sets "return_token_ids"
        choice["token_ids"] = token_ids
    return choice


def chat_chunk(response_id: str, created: int, model: str, index: int, delta: dict,
               finish_reason: str | None = None, logprobs: dict | None = None,
               token_ids: list[int] | None = None) -> dict:
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [_with_token_ids(choice, token_ids)]}


def completion_chunk(response_id: str, created: int, model: str, index: int, text: str,
                     finish_reason: str | None = None, logprobs: dict | None = None,
                     token_ids: list[int] | None = None) -> dict:
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    return {"id": response_id, "object": "text_completion", "created": created, "model": model,
            "choices": [_with_token_ids(choice, token_ids)]}


def usage_chunk(response_id: str, created: int, model: str, obj: str,
                usages: list[tuple[int, Usage | None]]) -> dict:
    return {"id": response_id, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage_dict(usages)}


def model_entry(model: str, created: int, info: dict) -> dict:
    """One model of /v1/models: OpenAI's fields, then exlcli's (max_model_len while loaded, status,
    memory_bytes, expires_at, ...)."""
    return {"id": model, "object": "model", "created": created, "owned_by": "exlcli", **info}


def embedding_list(model: str, vectors: list[list[float]], num_tokens: int, encoding_format: str) -> dict:
    """/v1/embeddings' answer; base64 is the vector's little-endian float32 bytes, as OpenAI sends it."""
    def encoded(vector: list[float]) -> list[float] | str:
        if encoding_format == "base64":
            return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
        return vector

    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": encoded(v)} for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}
