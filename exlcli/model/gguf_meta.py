"""GGUF headers: metadata as plain Python values, and tensor descriptions over a memory map.

`gguf.GGUFReader` builds a numpy view for every string of the vocabulary (about 100,000 of them
for SmolLM2), which takes seconds. `GGUFFile` reads the same header with `struct` in a fraction
of that and offers what the tensor loader uses from the reader: `.tensors`, each with `name`,
`tensor_type`, `shape`, `n_elements`, `n_bytes`, `data_offset` and `data` (a view of the memory
map laid out as GGUFReader lays it out).
"""

from __future__ import annotations

import mmap
import os
import struct
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from exlcli.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF value types -> struct format (little-endian)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
          10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY, _FLOAT32, _BOOL = 8, 9, 6, 7
_U64 = struct.Struct("<Q")
# tensor types stored as plain elements; every other type is blocks of bytes
_ELEMENT_TYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8,
                  "I16": np.int16, "I32": np.int32, "I64": np.int64}


class _Corrupt(Exception):
    pass


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray  # as GGUF lists it: innermost dimension first
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


class _Cursor:
    def __init__(self, buf: Any) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> Any:
        try:
            value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        except struct.error:
            raise _Corrupt("file ends inside the header") from None
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("<Q")
        end = self.pos + n
        if end > len(self.buf):
            raise _Corrupt("file ends inside the header")
        # errors="replace": a broken token string must not stop the load; it shows as U+FFFD
        text = bytes(self.buf[self.pos:end]).decode("utf-8", errors="replace")
        self.pos = end
        return text

    def strings(self, count: int) -> list[str]:
        """`count` strings one after another (a vocabulary: 50,000 to 250,000 of them), read in one loop
        without string()'s calls per item."""
        buf, pos, size, length = self.buf, self.pos, len(self.buf), _U64.unpack_from
        out: list[str] = []
        append = out.append
        try:
            for _ in range(count):
                end = pos + 8 + length(buf, pos)[0]
                if end > size:
                    raise _Corrupt("file ends inside the header")
                append(str(buf[pos + 8:end], "utf-8", "replace"))
                pos = end
        except struct.error:
            raise _Corrupt("file ends inside the header") from None
        self.pos = pos
        return out

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            sub, count = self.take("<I"), self.take("<Q")
            if sub == _STRING:
                return self.strings(count)
            if sub in _NUMPY:
                dtype = np.dtype(_NUMPY[sub])
                end = self.pos + dtype.itemsize * count
                if end > len(self.buf):
                    raise _Corrupt("file ends inside the header")
                values = np.frombuffer(self.buf, dtype, count, self.pos)
                self.pos = end
                if sub == _FLOAT32:
                    return [float(str(v)) for v in values]
                return [bool(v) for v in values] if sub == _BOOL else values.tolist()
            return [self.value(sub) for _ in range(count)]  # arrays of arrays
        if vtype not in _SCALARS:
            raise _Corrupt(f"unknown metadata value type {vtype}")
        value = self.take(_SCALARS[vtype])
        if vtype == _FLOAT32:
            # shortest decimal that round-trips the float32: 1e-05, not 9.999999747378752e-06
            return float(str(np.float32(value)))
        return value


class GGUFFile:
    """A GGUF file's metadata (`.metadata`) and tensors (`.tensors`), read from its header."""

    def __init__(self, path: str) -> None:
        import gguf

        self.path = path
        with open(path, "rb") as f:
            # a private mapping: its pages are the page cache's until written (nothing writes them), and arrays
            # of it are writable, so the loader's tensors view the file's bytes instead of copying them
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        buf = memoryview(self._map)
        c = _Cursor(buf)
        if bytes(buf[:4]) != GGUF_MAGIC:
            raise _Corrupt("not a GGUF file (bad magic)")
        c.pos = 4
        version = c.take("<I")
        if version not in (2, 3):
            raise _Corrupt(f"GGUF version {version} is not supported (2 and 3 are)")
        n_tensors, n_kv = c.take("<Q"), c.take("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = c.string()
            self.metadata[key] = c.value(c.take("<I"))
        infos = []
        for _ in range(n_tensors):
            name = c.string()
            dims = [c.take("<Q") for _ in range(c.take("<I"))]
            infos.append((name, dims, c.take("<I"), c.take("<Q")))
        align = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        if align <= 0 or align & (align - 1):
            raise _Corrupt(f"invalid alignment {align}")
        data_start = -(-c.pos // align) * align
        self.data_offset = data_start
        data = np.frombuffer(self._map, dtype=np.uint8)
        self.tensors: list[GGUFTensor] = []
        seen = set()
        for name, dims, raw_type, offset in infos:
            if name in seen:
                raise _Corrupt(f"duplicate tensor {name}")
            seen.add(name)
            try:
                qtype = gguf.GGMLQuantizationType(raw_type)
            except ValueError:
                raise _Corrupt(f"tensor {name} has unknown type {raw_type}") from None
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            n_elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
            n_bytes = n_elements * type_size // block
            start = data_start + offset
            if start + n_bytes > len(data):
                raise _Corrupt(f"truncated: tensor {name} runs past the end of the file")
            np_dims = tuple(reversed(dims))
            raw = data[start:start + n_bytes]
            if qtype.name in _ELEMENT_TYPES:
                view = raw.view(_ELEMENT_TYPES[qtype.name]).reshape(np_dims)
            else:
                if np_dims and np_dims[-1] % block:
                    raise _Corrupt(f"tensor {name}: row of {np_dims[-1]} is not a multiple of "
                                   f"the {qtype.name} block size {block}")
                byte_dims = (*np_dims[:-1], np_dims[-1] // block * type_size) if np_dims else (n_bytes,)
                view = raw.reshape(byte_dims)
            self.tensors.append(GGUFTensor(name, qtype, np.array(dims, dtype=np.uint64),
                                           n_elements, n_bytes, start, view))


def open_gguf(path: str | os.PathLike) -> Any:
    """The GGUF at `path` (a GGUFFile; a gguf.GGUFReader for big-endian files), or one clear
    ModelLoadError: missing, truncated, or not GGUF."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ModelLoadError(f"GGUF file not found: {path}")
    try:
        with open(path, "rb") as f:
            head = f.read(8)
        if sys.byteorder == "little" and len(head) == 8 and head[4:6] == b"\0\0" and head[6:8] != b"\0\0":
            import gguf  # a big-endian GGUF: rare, leave it to the reference reader

            return gguf.GGUFReader(path, "r")
        return GGUFFile(path)
    except _Corrupt as e:
        raise ModelLoadError(f"{path}: {e}") from None
    except (OSError, ValueError, KeyError, IndexError) as e:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def field_value(field: Any) -> Any:
    """One `gguf.ReaderField` as a plain Python value."""
    import gguf

    types = list(field.types)
    if not types:
        return None
    if types[0] == gguf.GGUFValueType.ARRAY:
        sub = types[-1]
        if sub == gguf.GGUFValueType.STRING:
            return [_text(field.parts[i]) for i in field.data]
        if sub == gguf.GGUFValueType.ARRAY:
            return None  # nested arrays: no key we use has them
        values = [_scalar(field.parts[i]) for i in field.data]
        if sub == gguf.GGUFValueType.FLOAT32:
            return [float(str(np.float32(v))) for v in values]
        return [bool(v) for v in values] if sub == gguf.GGUFValueType.BOOL else values
    if types[0] == gguf.GGUFValueType.STRING:
        return _text(field.parts[field.data[0]])
    value = _scalar(field.parts[field.data[0]])
    if types[0] == gguf.GGUFValueType.BOOL:
        return bool(value)
    if types[0] == gguf.GGUFValueType.FLOAT32:
        return float(str(np.float32(value)))
    return value


def _text(part: Any) -> str:
    return bytes(part).decode("utf-8", errors="replace")


def _scalar(part: Any) -> Any:
    value = part.tolist()
    if isinstance(value, list):
        value = value[0]
    return value


def metadata_from_reader(reader: Any) -> dict[str, Any]:
    """Metadata of an open_gguf() result (or of a gguf.GGUFReader)."""
    if isinstance(reader, GGUFFile):
        return dict(reader.metadata)
    try:
        return {name: field_value(field) for name, field in reader.fields.items()
                if not name.startswith("GGUF.")}
    except Exception as e:
        raise ModelLoadError(f"corrupt GGUF metadata ({type(e).__name__}: {e})") from None


def read_gguf_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """Every metadata key of a GGUF file (e.g. 'llama.block_count', 'tokenizer.ggml.tokens')."""
    return metadata_from_reader(open_gguf(path))
