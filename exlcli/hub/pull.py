"""`exlcli pull REPO[:FILE]`: a model from the Hugging Face Hub into the cache folder.

huggingface_hub speaks the Hub's protocol (the repository's file list, each file's URL, its
size and ETag from a HEAD request, the token and headers, the progress bar). The bytes go to
`<models>/.downloads/`, as `<file>.part` beside its ETag in `<file>.part.etag`; an interrupted pull
resumes with an HTTP Range request the next time, unless the file changed on the Hub meanwhile. A
finished file is checked (size; sha256 where the ETag is one, as for LFS files) and renamed into
place; a folder model appears under its name only once all its files are in. One pull of a name at
a time (filelock).
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, TextIO
from urllib.parse import urlsplit

from filelock import FileLock, Timeout

from exlcli import paths
from exlcli.errors import ModelLoadError

DOWNLOADS = ".downloads"
# What a Hugging Face folder model needs (top level only): config, weights, tokenizer, template.
FOLDER_FILES = ("*.json", "*.safetensors", "tokenizer.model", "*.jinja", "merges.txt", "vocab.txt")
_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class PullSpec:
    repo: str
    file: str | None = None  # a file name, or a part of one such as a quantization tag (Q4_K_M)
    revision: str = "main"


@dataclass(frozen=True)
class RemoteFile:
    path: str
    size: int | None = None


@dataclass(frozen=True)
class PullPlan:
    name: str  # the model's name in the cache folder: the GGUF's file name, or the folder's
    files: tuple[RemoteFile, ...]
    folder: bool


def parse_spec(text: str) -> PullSpec:
    """'user/repo', 'user/repo:model.Q4_K_M.gguf', 'user/repo:Q4_K_M', with an optional '@revision'
    after the repository and an optional https://huggingface.co/ (or hf.co/) in front."""
    spec = re.sub(r"^(https?://)?(huggingface\.co|hf\.co)/", "", text.strip())
    repo, _, file = spec.partition(":")
    repo, _, revision = repo.partition("@")
    if not _REPO.match(repo):
        raise ModelLoadError(f"cannot read {text!r} as REPO[:FILE]; give e.g. Qwen/Qwen2.5-0.5B-Instruct-GGUF:q4_k_m"
                             " or Qwen/Qwen2.5-0.5B-Instruct")
    return PullSpec(repo, file or None, revision or "main")


def plan_pull(spec: PullSpec, files: list[RemoteFile]) -> PullPlan:
    """Which files to fetch: the GGUF named (or the one GGUF), else the safetensors folder."""
    ggufs = [f for f in files if f.path.lower().endswith(".gguf")]
    top = [f for f in files if "/" not in f.path]
    if spec.file:
        exact = [f for f in files if spec.file in (f.path, f.path.rsplit("/", 1)[-1])]
        if exact and not exact[0].path.lower().endswith(".gguf"):
            raise ModelLoadError(f"{spec.repo}: {spec.file} is not a .gguf file; name a GGUF, or leave FILE out "
                                 "to fetch the repository's safetensors folder")
        matches = exact or [f for f in ggufs if spec.file.lower() in f.path.lower()]
        if len(matches) != 1:
            how = "several match" if matches else "none matches"
            raise ModelLoadError(f"{spec.repo}: {how} {spec.file!r}; its GGUF files: {_names(matches or ggufs)}")
        return PullPlan(matches[0].path.rsplit("/", 1)[-1], (matches[0],), folder=False)
    names = {f.path for f in top}
    if "config.json" in names and any(n.endswith(".safetensors") for n in names):
        wanted = tuple(f for f in top if any(fnmatch.fnmatch(f.path, p) for p in FOLDER_FILES))
        return PullPlan(folder_name(spec), wanted, folder=True)
    if len(ggufs) == 1:
        return PullPlan(ggufs[0].path.rsplit("/", 1)[-1], (ggufs[0],), folder=False)
    if ggufs:
        raise ModelLoadError(f"{spec.repo} has {len(ggufs)} GGUF files; name one as {spec.repo}:FILE "
                             f"(a part of the name such as q4_k_m will do): {_names(ggufs)}")
    raise ModelLoadError(f"{spec.repo} has no .gguf file and no safetensors folder (config.json + *.safetensors)")


def folder_name(spec: PullSpec) -> str:
    """A folder model's name in the cache: the repository's, and its branch where not main (EXL2 and EXL3
    repositories keep each bitrate on a branch, user/model-exl2@4.0bpw -> model-exl2-4.0bpw)."""
    name = spec.repo.split("/")[1]
    return name if spec.revision == "main" else f"{name}-{spec.revision.replace('/', '-')}"


def _names(files: list[RemoteFile]) -> str:
    shown = [f.path for f in files[:8]]
    return ", ".join(shown) + (f" and {len(files) - 8} more" if len(files) > 8 else "") if shown else "none"


def _endpoint() -> str | None:
    # huggingface_hub reads HF_ENDPOINT once, when it is imported; read it again for each pull
    return os.environ.get("HF_ENDPOINT") or None


def check_reachable(timeout: float = 10.0) -> None:
    """One quick request first, so that a machine without network fails at once, in one line
    (huggingface_hub itself retries a refused connection five times over some 20 s)."""
    import httpx

    host = _endpoint() or "https://huggingface.co"
    try:
        httpx.head(host, timeout=timeout)
    except httpx.HTTPError as e:
        raise ModelLoadError(f"cannot reach the Hub at {host} ({type(e).__name__}: {e}); check the network, "
                             "or HF_ENDPOINT for a mirror") from None


def list_files(spec: PullSpec, token: str | None = None) -> list[RemoteFile]:
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

    api = HfApi(endpoint=_endpoint(), token=token)
    return [RemoteFile(f.path, f.size) for f in api.list_repo_tree(spec.repo, recursive=True, revision=spec.revision)
            if isinstance(f, RepoFile)]


def pull(text: str, *, models_dir: Path | None = None, token: str | None = None, log: TextIO = sys.stderr) -> Path:
    """Fetch REPO[:FILE] into the cache folder (resuming what an earlier pull left); its path."""
    spec = parse_spec(text)
    folder = models_dir or paths.models_dir()
    check_reachable()
    with hub_errors(spec):
        plan = plan_pull(spec, list_files(spec, token))
        target = folder / plan.name
        if target.exists():
            print(f"pull: {plan.name} is already in {folder} (exlcli rm {plan.name} to fetch it again)", file=log)
            return target
        staging = folder / DOWNLOADS
        staging.mkdir(parents=True, exist_ok=True)
        with _only_pull(staging / f"{plan.name}.lock", plan.name, log):
            if target.exists():  # another pull finished it while we waited
                return target
            total = sum(f.size or 0 for f in plan.files)
            print(f"pull: {spec.repo} -> {target} ({len(plan.files)} file{'s' if len(plan.files) > 1 else ''}, "
                  f"{total / 1e6:.1f} MB)", file=log, flush=True)
            into = staging / plan.name if plan.folder else staging
            for f in plan.files:
                name = f.path if plan.folder else plan.name
                fetch_file(spec, f.path, into / name, token=token)
            os.replace(into / plan.name if not plan.folder else into, target)
    print(f"pull: ready: {target}", file=log)
    return target


def fetch_file(spec: PullSpec, path_in_repo: str, dest: Path, token: str | None = None) -> None:
    """One file to `dest`, resuming its `.part`; checked before the rename."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    if dest.is_file():
        return  # fetched by an earlier, interrupted pull of the same folder
    dest.parent.mkdir(parents=True, exist_ok=True)
    url = hf_hub_url(spec.repo, path_in_repo, revision=spec.revision, endpoint=_endpoint())
    meta = get_hf_file_metadata(url, token=token)
    etag = (meta.etag or "").strip('"')
    part, etag_file = dest.with_name(dest.name + ".part"), dest.with_name(dest.name + ".part.etag")
    have = part.stat().st_size if part.is_file() else 0
    if have and (not etag_file.is_file() or etag_file.read_text().strip() != etag
                 or (meta.size is not None and have > meta.size)):
        part.unlink()  # the file changed on the Hub since: start again
        have = 0
    etag_file.write_text(etag + "\n")
    headers = build_hf_headers(token=token)
    if urlsplit(meta.location).netloc != urlsplit(url).netloc:
        headers.pop("authorization", None)  # a CDN's signed URL: the token stays with the Hub
    with open(part, "ab") as f:
        http_get(meta.location, f, resume_size=have, headers=headers, expected_size=meta.size,
                 displayed_filename=dest.name)
    check_file(part, meta.size, etag, path_in_repo)
    os.replace(part, dest)
    etag_file.unlink()


def check_file(part: Path, size: int | None, etag: str, name: str) -> None:
    got = part.stat().st_size
    problem = None
    if size is not None and got != size:
        problem = f"{got} bytes, the Hub says {size}"
    elif _SHA256.match(etag):  # an LFS file's ETag is its sha256
        digest = hashlib.sha256()
        with open(part, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
        if digest.hexdigest() != etag:
            problem = "its sha256 differs from the Hub's"
    if problem:
        part.unlink()
        raise ModelLoadError(f"{name}: the download is damaged ({problem}); run the same pull again")


@contextlib.contextmanager
def _only_pull(lock_path: Path, name: str, log: TextIO) -> Iterator[None]:
    """One pull of a name at a time; a second one waits, and says so."""
    lock = FileLock(lock_path)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        print(f"pull: waiting for another exlcli pull of {name}", file=log, flush=True)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


@contextlib.contextmanager
def hub_errors(spec: PullSpec) -> Iterator[None]:
    """The Hub's and the network's errors as one ModelLoadError line."""
    try:
        yield
    except ModelLoadError:
        raise
    except Exception as error:
        message = hub_message(spec, error)
        if message is None:
            raise
        raise ModelLoadError(message) from None


def hub_message(spec: PullSpec, error: Exception) -> str | None:
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{spec.repo}@{spec.revision}"
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    transport = type(error).__module__.split(".")[0] in ("httpx", "httpx2", "requests", "urllib3", "huggingface_hub")
    if isinstance(error, GatedRepoError):
        return f"{where} is gated: accept its terms on the Hub and set HF_TOKEN"
    if isinstance(error, RepositoryNotFoundError):
        return f"{spec.repo}: no such repository on the Hub (or it is private: set HF_TOKEN)"
    if isinstance(error, RevisionNotFoundError):
        return f"{spec.repo}: no revision {spec.revision!r}"
    if isinstance(error, EntryNotFoundError):
        return f"{where}: {first}"
    if isinstance(error, HfHubHTTPError):
        return f"{where}: the Hub answered: {first}"
    if transport:
        return (f"cannot download {where} from {_endpoint() or 'https://huggingface.co'} "
                f"({type(error).__name__}: {first}); run the same pull again to resume")
    if isinstance(error, OSError):
        return f"pull {where}: {error.strerror or error}"
    return None
