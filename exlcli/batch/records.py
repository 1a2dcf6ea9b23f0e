"""Result lines, in the shape of the input line they answer.

native  {"id", "line", "text", "finish_reason", "usage": {...}, "timing": {...}}
        {"id", "line", "error": {"code", "message"}}
openai  {"id": "batch_req_...", "custom_id", "response": {"status_code": 200, "request_id", "body"},
         "error": null}, the body a real chat.completion / text_completion object;
        {"id", "custom_id", "response": null, "error": {"code", "message", "line"}}
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass

from exlcli.batch.failures import MAX_MESSAGE, safe_text
from exlcli.batch.lines import NATIVE, OPENAI, BadLine, Job
from exlcli.client.base import Usage


@dataclass
class Finished:
    """A request that ran to the end (finish_reason stop or length)."""

    job: Job
    text: str
    finish_reason: str
    usage: Usage
    request_id: str


def _hex() -> str:
    return uuid.uuid4().hex


def _round(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else round(value, 4)  # JSON has no inf


def result_record(done: Finished, model_name: str) -> dict:
    job, usage = done.job, done.usage
    if job.shape == NATIVE:
        return {
            "id": job.id, "line": job.line_no, "text": done.text, "finish_reason": done.finish_reason,
            "usage": {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                      "cached_tokens": usage.cached_tokens},
            "timing": {"queue_s": _round(usage.queue_time), "ttft_s": _round(usage.ttft),
                       "total_s": _round(usage.total_time), "decode_tps": _round(usage.decode_tps)},
        }
    return {"id": f"batch_req_{_hex()}", "custom_id": job.id,
            "response": {"status_code": 200, "request_id": f"req_{done.request_id}",
                         "body": openai_body(done, model_name)},
            "error": None}


def openai_body(done: Finished, model_name: str) -> dict:
    usage = done.usage
    body_usage = {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                  "total_tokens": usage.prompt_tokens + usage.completion_tokens,
                  "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}
    if done.job.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": done.text},
                  "logprobs": None, "finish_reason": done.finish_reason}
        return {"id": f"chatcmpl-{_hex()}", "object": "chat.completion", "created": int(time.time()),
                "model": model_name, "choices": [choice], "usage": body_usage}
    choice = {"index": 0, "text": done.text, "logprobs": None, "finish_reason": done.finish_reason}
    return {"id": f"cmpl-{_hex()}", "object": "text_completion", "created": int(time.time()),
            "model": model_name, "choices": [choice], "usage": body_usage}


def error_record(job_id: str, line_no: int, shape: str, code: str, message: str) -> dict:
    message = safe_text(message)[:MAX_MESSAGE]  # an error line must always be writable
    if shape == OPENAI:
        return {"id": f"batch_req_{_hex()}", "custom_id": job_id, "response": None,
                "error": {"code": code, "message": message, "line": line_no}}
    return {"id": job_id, "line": line_no, "error": {"code": code, "message": message}}


def bad_line_record(bad: BadLine) -> dict:
    return error_record(bad.id, bad.line_no, bad.shape, bad.code, bad.message)


# ---- reading a record back (resume) ----

def record_id(record: dict) -> str | None:
    value = record.get("custom_id") if "custom_id" in record else record.get("id")
    return value if isinstance(value, str) else None


def record_error_code(record: dict) -> str | None:
    """None for a good result, else the error's code ('error' when it has none)."""
    error = record.get("error")
    if error:
        return str(error.get("code") or "error") if isinstance(error, dict) else "error"
    if "custom_id" in record:
        response = record.get("response")
        if not isinstance(response, dict) or response.get("status_code") != 200:
            return "error"
    return None


def record_line(record: dict) -> int | None:
    line = record.get("line")
    if line is None and isinstance(record.get("error"), dict):
        line = record["error"].get("line")
    return line if isinstance(line, int) else None
