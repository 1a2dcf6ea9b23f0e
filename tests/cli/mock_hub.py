"""A Hugging Face Hub on 127.0.0.1 with the endpoints huggingface_hub calls for `exlcli pull`:

    GET  /api/models/{repo}/tree/{revision}?recursive=...   the file list (HfApi.list_repo_tree)
    HEAD /{repo}/resolve/{revision}/{path}                  X-Repo-Commit, ETag / X-Linked-Etag, size
    GET  /{repo}/resolve/{revision}/{path}                  the bytes; Range: bytes=N- answers 206

A file named in `stall` sends its first N bytes and then hangs (until `release()`), so a test can
interrupt a pull mid-file. Every request is recorded as (method, path, Range header).
"""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import json
import re
import threading
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

COMMIT = "0123456789abcdef0123456789abcdef01234567"
LFS_OVER = 1000  # bytes; bigger files are LFS files, whose ETag is their sha256 (as on the Hub)


@dataclass
class MockHub:
    repos: dict[str, dict[str, bytes]]  # repo -> path -> content
    stall: dict[str, int] = field(default_factory=dict)  # path -> bytes sent before hanging
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)
    released: threading.Event = field(default_factory=threading.Event)
    url: str = ""

    def release(self) -> None:
        self.stall.clear()
        self.released.set()

    def gets(self, path: str) -> list[str | None]:
        """The Range headers of the GETs of one file, in order (None: the whole file)."""
        return [r for m, p, r in self.requests if m == "GET" and p.endswith("/" + path)]


def _etag(content: bytes) -> str:
    if len(content) > LFS_OVER:
        return hashlib.sha256(content).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()  # git's blob id


def _handler(hub: MockHub):
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def _file(self) -> tuple[str, bytes] | None:
            route = r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$"
            m = re.match(route, unquote(urlsplit(self.path).path))
            if not m or m["repo"] not in hub.repos or m["path"] not in hub.repos[m["repo"]]:
                return None
            return m["path"], hub.repos[m["repo"]][m["path"]]

        def _not_found(self) -> None:
            self.send_response(404)
            self.send_header("X-Error-Code", "RepoNotFound")
            self.send_header("Content-Type", "application/json")
            body = b'{"error": "Repository not found"}'
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _file_headers(self, content: bytes) -> None:
            self.send_header("X-Repo-Commit", COMMIT)
            etag = _etag(content)
            self.send_header("ETag", f'"{etag}"')
            if len(content) > LFS_OVER:
                self.send_header("X-Linked-Etag", f'"{etag}"')
            self.send_header("Accept-Ranges", "bytes")

        def do_HEAD(self) -> None:
            hub.requests.append(("HEAD", urlsplit(self.path).path, None))
            found = self._file()
            if found is None:
                return self._not_found()
            self.send_response(200)
            self._file_headers(found[1])
            self.send_header("Content-Length", str(len(found[1])))
            self.end_headers()

        def do_GET(self) -> None:
            path = urlsplit(self.path).path
            hub.requests.append(("GET", path, self.headers.get("Range")))
            tree = re.match(r"^/api/models/(?P<repo>[^/]+/[^/]+)/tree/(?P<rev>[^/]+)$", unquote(path))
            if tree:
                return self._tree(tree["repo"])
            found = self._file()
            if found is None:
                return self._not_found()
            name, content = found
            start = 0
            wanted = re.match(r"bytes=(\d+)-$", self.headers.get("Range") or "")
            if wanted:
                start = int(wanted[1])
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{len(content) - 1}/{len(content)}")
            else:
                self.send_response(200)
            self._file_headers(content)
            self.send_header("Content-Length", str(len(content) - start))
            self.end_headers()
            body = content[start:]
            if name in hub.stall:
                self.wfile.write(body[:hub.stall[name] - start])
                self.wfile.flush()
                hub.released.wait(60)  # hang: the client is interrupted meanwhile
                self.close_connection = True
                return
            self.wfile.write(body)

        def _tree(self, repo: str) -> None:
            if repo not in hub.repos:
                return self._not_found()
            entries = []
            for path, content in sorted(hub.repos[repo].items()):
                entry = {"type": "file", "path": path, "size": len(content), "oid": _etag(content)}
                if len(content) > LFS_OVER:
                    entry["lfs"] = {"oid": _etag(content), "size": len(content), "pointerSize": 134}
                entries.append(entry)
            body = json.dumps(entries).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return Handler


class _QuietServer(http.server.ThreadingHTTPServer):
    """A client that hangs up early (the pull under test gave up, as it should) is not an error of
    the hub's: printing its traceback would land in the stderr the tests read."""

    def handle_error(self, request, client_address) -> None:
        pass


@contextlib.contextmanager
def running_hub(repos: dict[str, dict[str, bytes]]):
    hub = MockHub(repos)
    server = _QuietServer(("127.0.0.1", 0), _handler(hub))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield hub
    finally:
        hub.released.set()
        server.shutdown()
        server.server_close()
