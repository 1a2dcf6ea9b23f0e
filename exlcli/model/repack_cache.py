"""The repack cache: the CPU layouts a GGUF's load builds (QuantCpuLinear.from_blocks), kept in a file that the
next load of the same file memory-maps instead of repacking.

Why: a fresh anonymous page costs the kernel a clearing (on a VM, writing 2 GB of new memory takes seconds),
and an 8B model's layouts are 5 GB of them. Pages of a mapped file come from the page cache: a warm start
maps them, with no clearing and no repack. The first load repacks as before and writes the file after.

A file is one load's layouts, in the order the build asks for them, named by the model's path and the load's
options that change which weights are repacked (dtype, --quantize, the CPU expert layers), with its key in
its header: the GGUF's identity (real path, device, inode, size, mtime), the layout's version
(cpu_qmatmul.LAYOUT_VERSION), the CPU kernel's features the layout depends on, and those options. The header
(magic, format version, total length, the key, an index of records with each tensor's offset, shape and
type, its CRC) precedes the page-aligned tensors. A file whose header, key, length or index is not
right, or whose records do not fit the weights the load asks for, is never used: the load says so in one
line, repacks, and writes the file anew. A file is written on a thread after the load (the model answers
meanwhile; the process's exit waits for it), to a name of its own, then renamed over the final one (atomic:
two processes loading one model at once both load it, and one's file stays). The folder holds at most
`max_bytes()` (the least recently used go first), and only models whose layouts take `MIN_BYTES` or more
get a file. The tensors are mapped copy-on-write: nothing writes them after the load, and a write could
never reach the file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import secrets
import shutil
import struct
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, TypeVar

import torch

from exlcli import environment, paths
from exlcli.ops.formats import cpu_qmatmul
from exlcli.ops.formats.cpu_qmatmul import LAYOUT_STORE, Layout, StaleLayout

MAGIC = b"EXLRPACK"
FORMAT = 1  # the file format's version (the header, the index): bump with any change to either
HEAD = struct.Struct("<8sIIQI")  # magic, format, index length, total file length, CRC32 of the index
ALIGN = 4096  # each tensor starts on a page
MIN_BYTES = 256 << 20  # a model whose layouts take less gets no file: it repacks in well under a second
MAX_GIB = 32  # the folder's default bound ($EXLCLI_REPACK_CACHE_GIB)
FREE_RESERVE = 2 << 30  # the disk space a new file always leaves free
STALE_TEMP_S = 24 * 3600  # a temporary file this old is a crashed writer's
DTYPES = {"uint8": torch.uint8, "float16": torch.float16, "float32": torch.float32}
TENSORS = ("qs", "d", "m")

T = TypeVar("T")


def folder() -> Path:
    """Where the files live: the cache folder's repack/."""
    return paths.cache_dir() / "repack"


def max_bytes() -> int:
    """The most the folder holds: $EXLCLI_REPACK_CACHE_GIB GiB, else MAX_GIB."""
    gib = environment.number("EXLCLI_REPACK_CACHE_GIB")
    return (MAX_GIB if gib is None else max(gib, 0)) << 30


def enabled() -> bool:
    """Not turned off, and the CPU kernels that read the layouts are built (without them nothing is repacked)."""
    return not environment.flag("EXLCLI_NO_REPACK_CACHE") and cpu_qmatmul.available()


def cache_key(path: str, device: str, dtype: torch.dtype, options: dict) -> dict:
    """What a file's layouts depend on: the model file (which it is and which version of it), the layout's
    version, the CPU kernel's features, and the load's `options` that change which weights are repacked."""
    real = os.path.realpath(path)
    st = os.stat(real)
    return {"file": real, "dev": st.st_dev, "ino": st.st_ino, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "layout": cpu_qmatmul.LAYOUT_VERSION, "kernel_mode": cpu_qmatmul.kernel_mode(),
            "high_bit_planes": cpu_qmatmul.high_bit_planes(),
            "half_scales": cpu_qmatmul.half_scales_available(), "device": device,
            "dtype": str(dtype).removeprefix("torch."), "options": options}


def file_for(key: dict) -> Path:
    """The key's file, named by what chooses the layouts a load builds (the model's path, the device, the dtype,
    the options): a newer version of the model, layout or kernel finds the older one's file stale and
    replaces it."""
    which = json.dumps([key["file"], key["device"], key["dtype"], key["options"]], sort_keys=True)
    return folder() / f"{hashlib.sha256(which.encode()).hexdigest()[:32]}.bin"


class Unusable(Exception):
    """A file that must not be used; the message says why."""


@dataclass
class Record:
    desc: tuple[int, ...]
    layout: Layout


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _open(file: Path, key: dict) -> tuple[list[Record], mmap.mmap]:
    """The file's records, their tensors views of its memory map; Unusable where anything is not right."""
    with open(file, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(HEAD.size)
        if len(head) < HEAD.size:
            raise Unusable("truncated header")
        magic, version, index_len, total, crc = HEAD.unpack(head)
        if magic != MAGIC:
            raise Unusable("not a repack cache file")
        if version != FORMAT:
            raise Unusable(f"format {version}, not {FORMAT}")
        if total != size:
            raise Unusable(f"{size} bytes, not {total}")
        raw = f.read(index_len)
        if len(raw) != index_len or zlib.crc32(raw) != crc:
            raise Unusable("index damaged")
        try:
            index = json.loads(raw)
        except ValueError:
            raise Unusable("index damaged") from None
        if not isinstance(index, dict) or index.get("key") != key:
            raise Unusable("built for another file, version or CPU")
        data_start = HEAD.size + index_len
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    try:
        records = [_record(entry, mapped, data_start, size) for entry in index["records"]]
    except (KeyError, TypeError, ValueError, RuntimeError) as e:  # the map closes with the last view of it
        raise Unusable(f"index damaged ({e})") from None
    return records, mapped


def _record(entry: dict, mapped: mmap.mmap, data_start: int, size: int) -> Record:
    tensors: dict[str, torch.Tensor | None] = dict.fromkeys(TENSORS)
    for name, (offset, shape, dtype) in (entry["tensors"] or {}).items():
        dt = DTYPES[dtype]
        count = 1
        for dim in shape:
            count *= int(dim)
        nbytes = count * torch.tensor([], dtype=dt).element_size()
        if name not in tensors or offset < data_start or offset % ALIGN or offset + nbytes > size or count <= 0:
            raise ValueError(f"tensor {name} out of bounds")
        tensors[name] = torch.frombuffer(mapped, dtype=dt, count=count, offset=offset).view(shape)
    layout = Layout(tensors["qs"], tensors["d"], tensors["m"], bool(entry["offsets"]), bool(entry["half_scales"]),
                    bool(entry["declined"]))
    if not layout.declined and any(t is None for t in tensors.values()):
        raise ValueError("a layout without its tensors")
    return Record(tuple(int(v) for v in entry["desc"]), layout)


def _dtype_name(t: torch.Tensor) -> str:
    name = str(t.dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"a layout tensor of type {name}")
    return name


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass
class Plan:
    """A file's bytes as they will be written: the header and index, each tensor's offset, the length."""

    head: bytes
    placed: list[tuple[int, torch.Tensor]]
    total: int


def plan(key: dict, records: list[Record]) -> Plan:
    entries: list[dict] = []
    placed: list[tuple[int, torch.Tensor]] = []
    end = 0
    for r in records:
        tensors: dict[str, list] = {}
        for name in TENSORS:
            t = getattr(r.layout, name)
            if t is not None and not r.layout.declined:
                tensors[name] = [end, list(t.shape), _dtype_name(t)]  # from the data's start, for now
                placed.append((end, t))
                end = _aligned(end + _tensor_bytes(t))
        entries.append({"desc": list(r.desc), "offsets": r.layout.offsets, "half_scales": r.layout.half_scales,
                        "declined": r.layout.declined, "tensors": tensors})
    # the index holds the data's offsets, so its length depends on them: the data starts after room for both
    room = len(json.dumps({"key": key, "records": entries})) + 24 * len(placed) + 1024
    data_start = _aligned(HEAD.size + room)
    for entry in entries:
        for spec in entry["tensors"].values():
            spec[0] += data_start
    raw = json.dumps({"key": key, "records": entries}).encode()
    assert HEAD.size + len(raw) <= data_start
    raw += b" " * (data_start - HEAD.size - len(raw))  # blanks that json.loads reads past
    total = data_start + (placed[-1][0] + _tensor_bytes(placed[-1][1]) if placed else 0)
    head = HEAD.pack(MAGIC, FORMAT, len(raw), total, zlib.crc32(raw)) + raw
    return Plan(head, [(data_start + offset, t) for offset, t in placed], total)


def write(file: Path, key: dict, records: list[Record], planned: Plan | None = None) -> int:
    """The records to `file`, through a temporary file renamed over it; returns the bytes written."""
    planned = planned or plan(key, records)
    temp = file.with_name(f"{file.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(temp, "wb") as f:
            f.write(planned.head)
            for offset, t in planned.placed:
                f.seek(offset)
                f.write(t.contiguous().view(-1).view(torch.uint8).numpy().data)
            f.truncate(planned.total)
            f.flush()
            os.fsync(f.fileno())  # on the disk before its name is: after a crash, no file rather than a hollow one
        os.replace(temp, file)  # atomic: a reader opens the old file or the new one, whole
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
    return planned.total


def _make_room(file: Path, needed: int) -> str | None:
    """Evicts the folder's least recently used files until `needed` more bytes fit within max_bytes() and
    leave FREE_RESERVE of the disk free; returns why they cannot, None where they can."""
    limit = max_bytes()
    if needed > limit:
        return f"{needed / 2**30:.1f} GiB is over the bound of {limit / 2**30:.0f} GiB ($EXLCLI_REPACK_CACHE_GIB)"
    files, now = [], time.time()
    for p in file.parent.iterdir():
        with contextlib.suppress(OSError):
            st = p.stat()
            if p.name.endswith(".tmp") and now - st.st_mtime > STALE_TEMP_S:
                p.unlink()  # a crashed writer's
            elif p.suffix == ".bin":
                files.append((st.st_mtime, st.st_size, p))
    files.sort()  # the least recently used first
    held = sum(size for _, size, p in files if p != file)
    free = shutil.disk_usage(file.parent).free + sum(size for _, size, p in files if p == file)
    for _, size, p in files:
        if held + needed <= limit and needed + FREE_RESERVE <= free:
            break
        if p == file:
            continue  # replaced by the new one
        with contextlib.suppress(FileNotFoundError):
            p.unlink()  # a process that maps it keeps its pages until it ends
            held, free = held - size, free + size
    if needed + FREE_RESERVE > free:
        return f"{free / 2**30:.1f} GiB free on the disk"
    return None


@dataclass
class Session:
    """The LayoutStore of one load: the file's records in order where it has one (`held`), else the layouts
    the build repacks, kept to write."""

    held: list[Record] | None = field(repr=False)
    kept: list[Record] = field(default_factory=list, repr=False)
    used: int = 0

    def lookup(self, desc: tuple[int, ...]) -> Layout | None:
        if self.held is None:
            return None
        if self.used >= len(self.held) or self.held[self.used].desc != desc:
            raise StaleLayout(f"record {self.used} is not the weight the load asks for")
        self.used += 1
        return self.held[self.used - 1].layout

    def keep(self, desc: tuple[int, ...], layout: Layout) -> None:
        self.kept.append(Record(desc, layout))

    def kept_bytes(self) -> int:
        return sum(_tensor_bytes(t) for r in self.kept for t in (r.layout.qs, r.layout.d, r.layout.m)
                   if t is not None)


@contextlib.contextmanager
def _store(session: Session) -> Iterator[None]:
    token = LAYOUT_STORE.set(session)
    try:
        yield
    finally:
        LAYOUT_STORE.reset(token)


def notice_stale(file: Path, why: str) -> str:
    return f"exlcli: repack cache {file} is stale/truncated ({why}): rebuilt"


@dataclass
class Cache:
    """A load's file: its records where it holds usable ones (`held`, views of `mapped`), else None."""

    file: Path
    key: dict
    held: list[Record] | None = field(default=None, repr=False)
    mapped: mmap.mmap | None = field(default=None, repr=False)

    def read_order(self) -> list[tuple[int, int]]:
        """The file's bytes in the order the build reads them (what a prefetch asks for): all of it, in order."""
        return [(0, len(self.mapped))] if self.mapped is not None else []


def open_cache(key: dict, log) -> Cache:
    """The key's file, its records mapped where it is usable; where it is not, a one-line notice on `log`
    (a file that is not there yet gets none)."""
    cache = Cache(file_for(key), key)
    try:
        cache.held, cache.mapped = _open(cache.file, key)
    except FileNotFoundError:
        pass
    except Unusable as e:
        print(notice_stale(cache.file, str(e)), file=log, flush=True)
    except OSError as e:
        print(f"exlcli: repack cache {cache.file} unreadable ({e}): repacking", file=log, flush=True)
    return cache


def build_cached(build: Callable[[], T], cache: Cache, log) -> T:
    """`build()` (a model's build) with its CPU layouts from the cache's records where it holds usable ones,
    else repacked and written to its file (when they take MIN_BYTES or more). One-line notices go to `log`."""
    file, key, held = cache.file, cache.key, cache.held
    cache.held = cache.mapped = None  # the views of the map keep it open as long as the model holds them
    if held is not None:
        session = Session(held)
        try:
            with _store(session):
                built = build()
            if session.used != len(held):
                raise StaleLayout(f"{len(held)} records, the load asked for {session.used}")
        except StaleLayout as e:
            print(notice_stale(file, str(e)), file=log, flush=True)
        else:
            with contextlib.suppress(OSError):
                os.utime(file)  # its last use, for the eviction of the least recently used
            return built
        # the views of the mapped file go with the abandoned build (the mapping closes when the last does)
    del held
    session = Session(None)
    with _store(session):
        built = build()
    if session.kept_bytes() >= MIN_BYTES:
        # written on a thread of its own (not a daemon: the process's exit waits for it), so the model answers
        # while the file is written (an 8B's 5 GB took 8.7 s on a VM disk)
        writer = threading.Thread(target=_save, args=(file, key, session.kept, log), name="exlcli-repack-cache")
        _writers.append(writer)
        writer.start()
    return built


_writers: list[threading.Thread] = []


def _save(file: Path, key: dict, records: list[Record], log) -> None:
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        planned = plan(key, records)
        why = _make_room(file, planned.total)
        if why is None:
            write(file, key, records, planned)
        else:
            print(f"exlcli: repack cache not written: {why}", file=log, flush=True)
    except (OSError, ValueError) as e:  # ValueError: a closed log, a layout tensor of another type
        with contextlib.suppress(ValueError):
            print(f"exlcli: repack cache {file} not written ({e})", file=log, flush=True)


def wait_written() -> None:
    """Returns once the files this process's loads write are written (or given up)."""
    while _writers:
        _writers.pop().join()


def clear() -> tuple[int, int]:
    """Deletes every file of the folder; returns (files, bytes) deleted."""
    count = freed = 0
    here = folder()
    if not here.is_dir():
        return 0, 0
    for p in here.iterdir():
        if p.suffix in (".bin", ".tmp"):
            with contextlib.suppress(OSError):
                size = p.stat().st_size
                p.unlink()
                count, freed = count + 1, freed + size
    return count, freed
