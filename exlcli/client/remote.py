"""RemoteClient: the EngineClient of a running `exlcli serve`, over HTTP (streaming SSE).

Every generation streams, even when the caller only wants the whole text, so that `cancel()` and
the live display behave the same for every front end. A full server (503) is retried after its
Retry-After for up to `busy_wait_s` seconds, then reported.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import AsyncIterator, Iterator
from urllib.parse import quote

import httpx

from exlcli import environment
from exlcli.client.base import EngineClient, GenerationParams, GenerationStream, TextDelta, Usage
from exlcli.client.runtime_file import api_key_for, http_client_options
from exlcli.engine.request import TokenLogprob, response_format_of
from exlcli.engine.sampling import API_PARAMS
from exlcli.engine.stats import ActiveRequestInfo, EngineStats, FinishedRequestInfo
from exlcli.errors import ExlcliError, RequestError


def usage_from_dict(body: dict | None) -> Usage | None:
    if not body:
        return None
    details = body.get("prompt_tokens_details") or {}
    return Usage(prompt_tokens=int(body.get("prompt_tokens") or 0),
                 cached_tokens=int(details.get("cached_tokens") or 0),
                 completion_tokens=int(body.get("completion_tokens") or 0),
                 queue_time=float(body.get("queue_time") or 0.0), ttft=body.get("ttft"),
                 total_time=float(body.get("total_time") or 0.0),
                 decode_tps=float(body.get("decode_tps") or 0.0),
                 evicted_tokens=int(body.get("evicted_tokens") or 0))


CONNECT_TIMEOUT_S = 5.0
CALL_TIMEOUT_S = 30.0  # short calls (models, tokenize, stats); a stream may wait in queue forever


class ServerError(ExlcliError):
    """The server could not be reached, refused us, or failed."""


class ServerBusyError(ServerError):
    pass


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    return url.removesuffix("/v1")


def _error_message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text.strip()[:200] or response.reason_phrase


class RemoteClient(EngineClient):
    kind = "remote"

    def __init__(self, url: str, api_key: str | None = None, busy_wait_s: float = 60.0,
                 load_model: bool = True) -> None:
        """`load_model=False` loads nothing on the server: a default model not loaded there has
        context_length 0 (what `exlcli ps` wants: to look, not to change)."""
        self.url = normalize_url(url)
        self.busy_wait_s = busy_wait_s
        key = api_key or environment.text("EXLCLI_API_KEY") or api_key_for(self.url)
        self._http = httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {key}"} if key else {},
            timeout=httpx.Timeout(CALL_TIMEOUT_S, connect=CONNECT_TIMEOUT_S),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=32),
            **http_client_options(self.url))
        self.model: str | None = None  # the model requests name (None: the server's default)
        info = self._call("GET", "/v1/models")["data"][0]
        self.model_name = str(info["id"])
        self.context_length = int(info.get("max_model_len") or 0) or (self._load_context() if load_model else 0)

    def models(self) -> list[dict]:
        """The server's models (/v1/models' entries: id, status, memory_bytes, ...), the default first."""
        return list(self._call("GET", "/v1/models")["data"])

    def select_model(self, name: str) -> None:
        """Name `name` in every request from now on (a server of several models); it must be one of
        the server's models or their aliases. Its context is learned, loading it if need be."""
        entries = self.models()
        found = next((e for e in entries if name == e["id"] or name in e.get("aliases", ())), None)
        if found is None:
            served = ", ".join(str(e["id"]) for e in entries)
            raise RequestError(f"the server at {self.url} has no model {name!r}; it serves {served}")
        previous = self.model
        self.model = str(found["id"])
        try:
            self.context_length = int(found.get("max_model_len") or 0) or self._load_context()
        except ExlcliError:
            self.model = previous
            raise
        self.model_name = self.model

    def _load_context(self) -> int:
        """The context of the model (loaded by the server first if it is not): /tokenize reports it."""
        body = {"messages": [{"role": "user", "content": ""}], **self._model_field()}
        return int(self._call("POST", "/tokenize", body).get("max_model_len") or 0)

    def _model_field(self) -> dict:
        return {"model": self.model} if getattr(self, "model", None) else {}

    # ---- plumbing ----

    def _check(self, response: httpx.Response) -> None:
        if response.status_code < 400:
            return
        message = _error_message(response)
        if response.status_code == 400:
            raise RequestError(message)
        if response.status_code == 401:
            raise ServerError(f"the server at {self.url} refused the API key; pass --api-key or set EXLCLI_API_KEY")
        if response.status_code == 503:
            raise ServerBusyError(f"the server at {self.url} is busy: {message}")
        raise ServerError(f"the server at {self.url} answered {response.status_code}: {message}")

    def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        try:
            response = self._http.request(method, path, json=body)
        except httpx.HTTPError as e:
            raise ServerError(f"cannot reach the exlcli server at {self.url} ({type(e).__name__}: {e})") from None
        self._check(response)
        return response.json()

    def _open_stream(self, path: str, body: dict) -> httpx.Response:
        """POST and return the streaming response once its headers are in; wait out a busy server."""
        deadline = time.monotonic() + self.busy_wait_s
        while True:
            request = self._http.build_request("POST", path, json=body, timeout=httpx.Timeout(
                None, connect=CONNECT_TIMEOUT_S))
            try:
                response = self._http.send(request, stream=True)
            except httpx.HTTPError as e:
                raise ServerError(f"cannot reach the exlcli server at {self.url} ({type(e).__name__}: {e})") from None
            if response.status_code != 503 or time.monotonic() >= deadline:
                break
            response.read()
            response.close()
            try:
                wait = float(response.headers.get("retry-after", "1"))
            except ValueError:
                wait = 1.0
            time.sleep(max(0.05, min(wait, deadline - time.monotonic())))
        if response.status_code >= 400:
            response.read()
            response.close()
            self._check(response)
        return response

    @staticmethod
    def _sampling_body(params: GenerationParams) -> dict:
        return {
            **{p.name: getattr(params, p.name) for p in API_PARAMS},  # the server reads them by these names
            "stop": list(params.stop), "priority": params.priority,
            "client": params.client, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True, "response_format": response_format_of(params.grammar),
            **{k: v for k, v in (("context_overflow", params.context_overflow), ("sink_tokens", params.sink_tokens),
                                 ("window", params.window), ("session", params.session)) if v is not None},
        }

    # ---- EngineClient ----

    def chat(self, messages: list[dict], params: GenerationParams) -> GenerationStream:
        if params.tools:  # the stream would carry tool_calls this client does not read
            raise RequestError("tools are not available through a remote engine; call the server's API directly")
        body = {"messages": messages, **self._model_field(), **self._sampling_body(params)}
        if params.speculative is not None:
            body["speculative"] = params.speculative
        if params.logprobs:
            body.update(logprobs=True, top_logprobs=params.logprobs)
        return RemoteStream(self, self._open_stream("/v1/chat/completions", body), chat=True)

    def complete(self, prompt: str, params: GenerationParams) -> GenerationStream:
        body = {"prompt": prompt, **self._model_field(), **self._sampling_body(params)}
        if params.speculative is not None:
            body["speculative"] = params.speculative
        if params.logprobs:
            body["logprobs"] = params.logprobs
        return RemoteStream(self, self._open_stream("/v1/completions", body), chat=False)

    def count_chat_tokens(self, messages: list[dict], add_generation_prompt: bool = True,
                          tools: list[dict] | None = None) -> int:
        body: dict = {"messages": messages, "add_generation_prompt": add_generation_prompt,
                      **self._model_field()}
        if tools:
            body["tools"] = tools
        return int(self._call("POST", "/tokenize", body)["count"])

    def stats(self) -> EngineStats:
        data = self._call("GET", "/stats" + (f"?model={quote(self.model)}" if self.model else ""))
        data["active"] = [ActiveRequestInfo(**a) for a in data.get("active", [])]
        data["recent_finished"] = [FinishedRequestInfo(**f) for f in data.get("recent_finished", [])]
        return EngineStats(**data)

    def cancel_remote(self, response_id: str) -> None:
        try:
            self._http.post(f"/cancel/{response_id}", timeout=2.0)
        except httpx.HTTPError:
            pass  # the stream is being closed as well, which cancels it too

    def close(self) -> None:
        self._http.close()


_END = object()


class RemoteStream(GenerationStream):
    def __init__(self, client: RemoteClient, response: httpx.Response, chat: bool) -> None:
        self.request_id = response.headers.get("x-request-id", "")
        self._client = client
        self._response = response
        self._chat = chat
        self._cancelled = threading.Event()
        self._done = False

    def cancel(self) -> None:
        if self._done or self._cancelled.is_set():
            return
        self._cancelled.set()
        if self.request_id:
            self._client.cancel_remote(self.request_id)  # ends the stream at the server
        self._response.close()

    def _deltas(self) -> Iterator[TextDelta]:
        finish_reason: str | None = None
        try:
            for line in self._response.iter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[len("data: "):]
                if payload == "[DONE]":
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    yield TextDelta(finish_reason="error", error=str(chunk["error"].get("message")))
                    return
                if chunk.get("usage") is not None and not chunk.get("choices"):
                    reason = finish_reason or ("cancelled" if self._cancelled.is_set() else "stop")
                    yield TextDelta(finish_reason=reason, usage=usage_from_dict(chunk["usage"]))
                    return
                for choice in chunk.get("choices", []):
                    delta = self._choice_delta(choice)
                    if delta.text or delta.token_ids or delta.logprobs:
                        yield delta
                    finish_reason = choice.get("finish_reason") or finish_reason
        except (httpx.HTTPError, OSError, ValueError, RuntimeError) as e:
            if not self._cancelled.is_set():
                yield TextDelta(finish_reason="error", error=f"lost the server stream ({type(e).__name__}: {e})",
                                lost=True)
                return
        finally:
            self._response.close()
        if self._cancelled.is_set():
            yield TextDelta(finish_reason="cancelled")
        elif finish_reason is not None:
            yield TextDelta(finish_reason=finish_reason)
        else:
            yield TextDelta(finish_reason="error", error="the server closed the stream early", lost=True)

    def _choice_delta(self, choice: dict) -> TextDelta:
        text = (choice.get("delta") or {}).get("content") or "" if self._chat else choice.get("text") or ""
        return TextDelta(text=text, token_ids=list(choice.get("token_ids") or []),
                         logprobs=_parse_logprobs(choice.get("logprobs"), self._chat))

    def __iter__(self) -> Iterator[TextDelta]:
        for delta in self._deltas():
            if delta.finished:
                self._done = True
            yield delta

    async def __aiter__(self) -> AsyncIterator[TextDelta]:
        # One reader thread per stream (not the loop's small default pool), feeding this loop.
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def put(item: object) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:
                pass  # the loop is gone; nobody is listening any more

        def reader() -> None:
            try:
                for delta in self:
                    put(delta)
            except BaseException as e:  # handed to the consumer, raised there
                put(e)
            finally:
                put(_END)

        threading.Thread(target=reader, name=f"exlcli-remote-{self.request_id}", daemon=True).start()
        try:
            while True:
                item = await queue.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if not self._done:
                self.cancel()


def _parse_logprobs(body: dict | None, chat: bool) -> list[TokenLogprob] | None:
    if not body:
        return None
    if chat:
        return [TokenLogprob(int(e.get("token_id", -1)), float(e["logprob"]),
                             [(int(t.get("token_id", -1)), float(t["logprob"])) for t in e.get("top_logprobs", [])])
                for e in body.get("content") or []]
    ids = list(body.get("token_ids") or [])
    return [TokenLogprob(int(ids[i]) if i < len(ids) else -1, float(lp))
            for i, lp in enumerate(body.get("token_logprobs") or [])]
