"""The per-user runtime file where a running `exlcli serve` records its address, so that `chat`,
`batch` and `bench` can find it and attach instead of loading a second copy of the model.

The file lives in $EXLCLI_RUNTIME_DIR, else $XDG_RUNTIME_DIR/exlcli, else the cache folder
(exlcli/paths.py); the folder is 0700 and the file 0600, because it holds the server's API key when
there is one (the same trust a user's own files get, as Jupyter does with its runtime files).
"""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
import stat
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import psutil

from exlcli import paths
from exlcli.errors import ExlcliError


def is_loopback_host(host: str) -> bool:
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve anywhere


FILE_NAME = "server.json"
HEALTH_TIMEOUT_S = 0.5


@dataclass
class ServerRecord:
    url: str
    pid: int
    model: str
    api_key: str | None = None
    started: float = field(default_factory=time.time)


def runtime_dir() -> Path:
    return paths.runtime_dir()


def runtime_path() -> Path:
    return runtime_dir() / FILE_NAME


def secure_runtime_dir() -> str | None:
    """Make the runtime folder (0700) or check the one there: another user's folder is refused; one
    of ours that others may read or write (say 0755 or 0777, where another user could swap the
    record for one that points our clients, and their key, elsewhere) is narrowed to 0700. Returns
    what was fixed, for the server to say."""
    folder = runtime_dir()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    if os.name != "posix":
        return None
    info = folder.lstat()
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise ExlcliError(f"the runtime folder {folder} is a link or not a folder; remove it or set EXLCLI_RUNTIME_DIR")
    if info.st_uid != os.getuid():
        raise ExlcliError(f"the runtime folder {folder} belongs to another user (uid {info.st_uid}); "
                          "set EXLCLI_RUNTIME_DIR to a folder of your own")
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o077:
        os.chmod(folder, 0o700)
        return f"the runtime folder {folder} was mode {mode:04o}; now 0700"
    return None


def write_record(record: ServerRecord) -> Path:
    path = runtime_path()
    secure_runtime_dir()
    # A new file of our own under an unguessable name: O_EXCL never reuses a file or a planted
    # link there, and O_NOFOLLOW refuses a link even where O_EXCL alone would not be enough.
    tmp = path.with_name(f".{FILE_NAME}.{os.getpid()}.{secrets.token_hex(8)}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(tmp, flags, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(record), f)
        os.replace(tmp, path)  # atomic: a reader sees the old file or the new one, never half
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def read_record() -> ServerRecord | None:
    try:
        data = json.loads(runtime_path().read_text())
        return ServerRecord(url=str(data["url"]), pid=int(data["pid"]), model=str(data.get("model", "")),
                            api_key=data.get("api_key") or None, started=float(data.get("started", 0.0)))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def remove_record(pid: int | None = None) -> None:
    """Remove the file if it is ours (names `pid`, default this process): a newer server that
    replaced it keeps its record."""
    record = read_record()
    if record is not None and record.pid != (pid or os.getpid()):
        return
    try:
        runtime_path().unlink()
    except FileNotFoundError:
        pass


def _process_alive(pid: int) -> bool:
    # psutil asks the system without a signal: os.kill(pid, 0) would send Ctrl-C on Windows
    return psutil.pid_exists(pid)


def http_client_options(url: str) -> dict:
    # A proxy from the environment must never sit between us and a server on this machine.
    host = urlsplit(url).hostname or ""
    return {"trust_env": not is_loopback_host(host)}


def server_answers(url: str, timeout: float = HEALTH_TIMEOUT_S) -> bool:
    try:
        response = httpx.get(url.rstrip("/") + "/health", timeout=timeout, **http_client_options(url))
    except httpx.HTTPError:
        return False
    return response.status_code == 200


def find_running_server(timeout: float = HEALTH_TIMEOUT_S) -> str | None:
    """The URL of a running `exlcli serve` that answers /health within `timeout`, else None.
    A record left by a server that died is removed."""
    record = read_record()
    if record is None:
        return None
    if not _process_alive(record.pid):
        remove_record(record.pid)
        return None
    return record.url if server_answers(record.url, timeout) else None


def api_key_for(url: str) -> str | None:
    """The key a server recorded for itself, when `url` is that server."""
    record = read_record()
    if record is None or record.url.rstrip("/") != url.rstrip("/"):
        return None
    return record.api_key
