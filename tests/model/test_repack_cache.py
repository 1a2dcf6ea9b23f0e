"""The repack cache (exlcli/model/repack_cache.py): a GGUF's CPU layouts written on the first load, mapped on
the next with no repack and the same logits bit for bit; a truncated or stale file named in one line, rebuilt,
never used; two processes loading at once; the switch that turns it off; the folder's bound."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_gguf_loader import prefill_logits, tiny_hf_model, write_gguf  # tests/model/test_gguf_loader.py

from exlcli.model import repack_cache
from exlcli.model.loader import load_model
from exlcli.ops.formats import cpu_qmatmul
from exlcli.ops.formats.cpu_qmatmul import QuantCpuLinear

pytestmark = pytest.mark.skipif(not cpu_qmatmul.available() or cpu_qmatmul._repack() is None,
                                reason="the C repack is not built")

REPO = Path(__file__).resolve().parents[2]
IDS = [5, 17, 33, 2, 60, 41, 9, 9, 12, 50, 3]
# the C repack's formats at each layout: 4-bit with offsets (Q4_0, Q4_1), 8-bit, 5-bit
QUANTIZE = {"attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q8_0", "attn_output": "Q5_0", "ffn": "Q4_1",
            "output.": "Q8_0"}


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("repack") / "tiny.gguf"
    write_gguf(path, tiny_hf_model("llama"), "llama", quantize=QUANTIZE)
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A cache folder of the test's own, and no size threshold (the tiny model's layouts are a few KB)."""
    monkeypatch.setenv("EXLCLI_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("EXLCLI_NO_REPACK_CACHE", raising=False)
    monkeypatch.delenv("EXLCLI_REPACK_CACHE_GIB", raising=False)
    monkeypatch.setattr(repack_cache, "MIN_BYTES", 0)
    monkeypatch.setattr(repack_cache, "FREE_RESERVE", 0)
    return tmp_path / "cache" / "repack"


class Log:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def write(self, text: str) -> None:
        self.lines += [line for line in text.splitlines() if line]

    def flush(self) -> None:
        pass


def _load(path: Path, log: Log | None = None, **kw):
    loaded = load_model(str(path), device="cpu", log=log or Log(), **kw)
    repack_cache.wait_written()  # the file is written on a thread
    return loaded


def _linears(loaded) -> list[QuantCpuLinear]:
    seen: dict[int, QuantCpuLinear] = {}

    def walk(obj, depth=0):
        if depth > 6:
            return
        if isinstance(obj, QuantCpuLinear):
            seen.setdefault(id(obj), obj)
            return
        if isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v, depth + 1)
        elif hasattr(obj, "__dict__") and not isinstance(obj, torch.Tensor):
            for v in vars(obj).values():
                walk(v, depth + 1)

    walk(loaded.model)
    return list(seen.values())


def _no_repack(monkeypatch):
    def fail(*a, **kw):
        raise AssertionError("the C repack ran on a cache hit")

    monkeypatch.setattr(QuantCpuLinear, "_repacked", classmethod(fail))


def test_second_load_maps_the_file_with_no_repack_and_the_same_logits(gguf_file, cache, monkeypatch):
    first = _load(gguf_file)
    files = list(cache.glob("*.bin"))
    assert len(files) == 1
    want = prefill_logits(first, IDS)
    want_layouts = [(lin.qs.clone(), lin.d.clone(), lin.m.clone(), lin.offsets, lin.half_scales)
                    for lin in _linears(first)]
    assert len(want_layouts) >= 7 and {lin.bits for lin in _linears(first)} >= {4, 8}

    _no_repack(monkeypatch)
    log = Log()
    second = _load(gguf_file, log)
    assert not [line for line in log.lines if "repack cache" in line]
    got = prefill_logits(second, IDS)
    assert torch.equal(got, want)
    got_layouts = _linears(second)
    assert len(got_layouts) == len(want_layouts)
    for lin, (qs, d, m, offsets, half) in zip(got_layouts, want_layouts):
        assert torch.equal(lin.qs, qs) and torch.equal(lin.d, d) and torch.equal(lin.m, m)
        assert (lin.offsets, lin.half_scales) == (offsets, half)
    # the layouts are views of the file's memory map, and nothing of the load or the forward wrote them (a
    # written page of the copy-on-write map would be an anonymous one)
    maps = _mappings(files[0])
    assert maps, "the file is not mapped"
    for lin in got_layouts:
        for t in (lin.qs, lin.d, lin.m):
            assert any(lo <= t.data_ptr() < hi for lo, hi, _ in maps)
    assert all(anonymous == 0 for _, _, anonymous in maps)


def _mappings(file: Path) -> list[tuple[int, int, int]]:
    """This process's mappings of `file`: (start, end, anonymous kB), from /proc/self/smaps."""
    out: list[tuple[int, int, int]] = []
    current = None
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:
                lo, hi = (int(v, 16) for v in fields[0].split("-"))
                current = [lo, hi, 0] if len(fields) >= 6 and fields[5] == str(file) else None
                if current is not None:
                    out.append(current)  # type: ignore[arg-type]
            elif current is not None and fields[0] == "Anonymous:":
                current[2] = int(fields[1])
    return [tuple(m) for m in out]  # type: ignore[misc]


def _key(gguf_file: Path) -> dict:
    options = {"quantize": None, "cpu_moe": False, "n_cpu_moe": None}
    return repack_cache.cache_key(str(gguf_file), "cpu", torch.bfloat16, options)


def _corrupt_and_reload(gguf_file, cache, monkeypatch, damage) -> list[str]:
    want = prefill_logits(_load(gguf_file), IDS)
    (file,) = cache.glob("*.bin")
    damage(file)
    calls = []
    real = QuantCpuLinear._repacked.__func__  # type: ignore[attr-defined]
    monkeypatch.setattr(QuantCpuLinear, "_repacked",
                        classmethod(lambda cls, *a: calls.append(1) or real(cls, *a)))
    log = Log()
    loaded = _load(gguf_file, log)
    assert calls, "a file that must not be used was used"
    assert torch.equal(prefill_logits(loaded, IDS), want)
    # rewritten: the next load maps it
    _no_repack(monkeypatch)
    log_again = Log()
    assert torch.equal(prefill_logits(_load(gguf_file, log_again), IDS), want)
    assert not log_again.lines
    return log.lines


def test_a_truncated_file_is_named_rebuilt_and_never_used(gguf_file, cache, monkeypatch):
    def truncate(file: Path) -> None:
        os.truncate(file, file.stat().st_size - 4096)

    lines = _corrupt_and_reload(gguf_file, cache, monkeypatch, truncate)
    assert len(lines) == 1 and "is stale/truncated" in lines[0] and "rebuilt" in lines[0]


def test_a_file_for_another_key_or_layout_version_is_rebuilt(gguf_file, cache, monkeypatch):
    def other_key(file: Path) -> None:
        key = _key(gguf_file) | {"layout": cpu_qmatmul.LAYOUT_VERSION + 1}
        records, _ = repack_cache._open(file, _key(gguf_file))
        repack_cache.write(file, key, records)

    lines = _corrupt_and_reload(gguf_file, cache, monkeypatch, other_key)
    assert len(lines) == 1 and "is stale/truncated (built for another" in lines[0]


def test_records_that_do_not_fit_the_weights_are_rebuilt(gguf_file, cache, monkeypatch):
    def swapped(file: Path) -> None:  # a header that is right, records in another order
        records, _ = repack_cache._open(file, _key(gguf_file))
        repack_cache.write(file, _key(gguf_file), records[::-1])

    lines = _corrupt_and_reload(gguf_file, cache, monkeypatch, swapped)
    assert len(lines) == 1 and "is stale/truncated (record 0" in lines[0]


def test_a_newer_model_file_finds_the_old_layouts_stale(gguf_file, cache, tmp_path):
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(gguf_file.read_bytes())
    _load(copy)
    os.utime(copy, ns=(copy.stat().st_atime_ns, copy.stat().st_mtime_ns + 10**9))
    log = Log()
    _load(copy, log)
    assert len(log.lines) == 1 and "built for another file" in log.lines[0]
    assert len(list(cache.glob("*.bin"))) == 1


def test_the_switch_and_the_variable_turn_it_off(gguf_file, cache, monkeypatch):
    _load(gguf_file, repack_cache=False)
    assert not cache.exists() or not list(cache.iterdir())
    monkeypatch.setenv("EXLCLI_NO_REPACK_CACHE", "1")
    _load(gguf_file)
    assert not cache.exists() or not list(cache.iterdir())


def test_small_models_write_no_file(gguf_file, cache, monkeypatch):
    monkeypatch.setattr(repack_cache, "MIN_BYTES", 256 << 20)
    _load(gguf_file)
    assert not cache.exists() or not list(cache.iterdir())


def test_the_bound_evicts_the_least_recently_used(gguf_file, cache, tmp_path, monkeypatch):
    copies = []
    for i in range(3):
        copy = tmp_path / f"m{i}.gguf"
        copy.write_bytes(gguf_file.read_bytes())
        copies.append(copy)
    _load(copies[0])
    size = next(cache.glob("*.bin")).stat().st_size
    _load(copies[1])
    first, second = sorted(cache.glob("*.bin"), key=lambda p: p.stat().st_mtime)
    os.utime(first, (1, 1))  # copies[0]'s file, used longest ago
    # room for two files: a third evicts the least recently used
    monkeypatch.setattr(repack_cache, "max_bytes", lambda: 2 * size + size // 2)
    _load(copies[2])
    left = set(cache.glob("*.bin"))
    assert len(left) == 2 and first not in left and second in left
    # a file that fits no bound is not written, and says so
    monkeypatch.setattr(repack_cache, "max_bytes", lambda: 1024)
    log = Log()
    other = tmp_path / "m3.gguf"
    other.write_bytes(gguf_file.read_bytes())
    _load(other, log)
    assert len(log.lines) == 1 and log.lines[0].startswith("exlcli: repack cache not written")
    assert set(cache.glob("*.bin")) == left


def test_clear_deletes_every_file(gguf_file, cache):
    _load(gguf_file)
    assert repack_cache.clear()[0] == 1
    assert not list(cache.iterdir())


CHILD = """
import sys, torch
from exlcli.model import repack_cache
from exlcli.model.loader import load_model
repack_cache.MIN_BYTES = 0
repack_cache.FREE_RESERVE = 0
loaded = load_model(sys.argv[1], device="cpu")
print(float(loaded.model.forward.__self__ is not None))
"""


def test_two_processes_loading_at_once_both_work_and_leave_one_file(gguf_file, cache):
    env = {**os.environ, "PYTHONPATH": str(REPO), "EXLCLI_CACHE": str(cache.parent), "EXLCLI_CPU_THREADS": "1"}
    env.pop("EXLCLI_NO_REPACK_CACHE", None)
    for _ in range(2):  # both writing (no file yet), then both mapping the one left
        procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(gguf_file)], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(2)]
        for p in procs:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-2000:]
            assert "repack cache" not in err
        files = list(cache.iterdir())
        assert len(files) == 1 and files[0].suffix == ".bin"
        repack_cache._open(files[0], _key(gguf_file))  # whole


def test_run_no_repack_cache_flag_reaches_the_load(gguf_file, cache, monkeypatch):
    from typer.testing import CliRunner

    from exlcli.cli.app import app

    result = CliRunner().invoke(app, ["run", "-m", str(gguf_file), "--raw", "-n", "1", "--temp", "0",
                                      "--no-repack-cache", "!#%"])
    assert result.exit_code == 0, result.output
    assert not cache.exists() or not list(cache.iterdir())
    result = CliRunner().invoke(app, ["run", "-m", str(gguf_file), "--raw", "-n", "1", "--temp", "0", "!#%"])
    assert result.exit_code == 0, result.output
    repack_cache.wait_written()
    assert len(list(cache.glob("*.bin"))) == 1


@pytest.mark.parametrize("damage", ["magic", "index", "offset"])
def test_a_damaged_header_or_index_is_never_used(gguf_file, cache, monkeypatch, damage):
    def break_it(file: Path) -> None:
        data = bytearray(file.read_bytes())
        if damage == "magic":
            data[:8] = b"NOTMAGIC"
        elif damage == "index":  # a byte of the index: its CRC no longer matches
            data[repack_cache.HEAD.size + 10] ^= 0xFF
        else:  # an index that is right (CRC included) with a tensor past the end
            records, mapped = repack_cache._open(file, _key(gguf_file))
            planned = repack_cache.plan(_key(gguf_file), records)
            head = planned.head.replace(b'"tensors": {"qs": [', b'"tensors": {"qs": [9', 1)
            raw = head[repack_cache.HEAD.size:].rstrip(b" ")
            raw += b" " * (len(planned.head) - repack_cache.HEAD.size - len(raw))
            _, fmt, _, total, _ = repack_cache.HEAD.unpack(planned.head[:repack_cache.HEAD.size])
            import zlib
            head = repack_cache.HEAD.pack(repack_cache.MAGIC, fmt, len(raw), total, zlib.crc32(raw)) + raw
            assert len(head) == len(planned.head)
            data[:len(head)] = head
        file.write_bytes(bytes(data))

    lines = _corrupt_and_reload(gguf_file, cache, monkeypatch, break_it)
    assert len(lines) == 1 and "is stale/truncated" in lines[0]
