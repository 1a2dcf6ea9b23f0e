"""The CPU kernels' argument structs: exlcli/csrc/cpu/args.h and the ctypes Structures of
exlcli/ops/cpu/args.py must lay out every field alike, or a kernel reads garbage. The C side is
measured by a small program that the system compiler builds from the header (no AVX-512 needed)."""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess

import pytest

from exlcli.ops.cpu import args as cpu_args
from exlcli.ops.cpu import loader as cpu_loader

HEADER = cpu_loader.CSRC_CPU / "args.h"
COMPILER = os.environ.get("CC", "cc")
needs_compiler = pytest.mark.skipif(shutil.which(COMPILER) is None, reason=f"no C compiler ({COMPILER})")

_CTYPES_KIND = {ctypes.c_void_p: "pointer", ctypes.c_int64: "int64_t", ctypes.c_int32: "int32_t",
                ctypes.c_float: "float"}
_FIELD = re.compile(r"(?:const\s+)?(\w+)\s*(\*?)\s*(\w+)\s*;")


def _header_structs() -> dict[str, list[tuple[str, str]]]:
    """{struct name: [(field, kind)]} as args.h declares them, in order; kind is int64_t, int32_t,
    float or pointer. Every line of a struct must be one plain field: nothing is skipped."""
    text = re.sub(r"//[^\n]*", "", HEADER.read_text())
    structs = {}
    for body, name in re.findall(r"typedef\s+struct\s*\{(.*?)\}\s*(\w+)\s*;", text, re.S):
        fields = []
        for line in filter(None, (ln.strip() for ln in body.splitlines())):
            match = _FIELD.fullmatch(line)
            assert match, f"{name}: {line!r} is not one `type name;` field (args.h keeps to that format)"
            ctype, star, field = match.groups()
            kind = "pointer" if star else ctype
            assert kind in ("int64_t", "int32_t", "float", "pointer"), f"{name}.{field}: {ctype} is not fixed-width"
            fields.append((field, kind))
        structs[name] = fields
    return structs


def _header_kernels() -> dict[str, str]:
    """{kernel function: the struct it takes a pointer to} from args.h's prototypes."""
    return dict(re.findall(r"\bint\s+(exl_\w+)\s*\(\s*const\s+(\w+)\s*\*\s*args\s*\)\s*;", HEADER.read_text()))


def _c_layout(structs: dict[str, list[tuple[str, str]]], tmp_path) -> dict[str, list[int]]:
    """{struct: [sizeof, then offset and size of each field]} as the C compiler lays them out."""
    lines = ['#include <stddef.h>', '#include <stdio.h>', '#include "args.h"', "int main(void) {"]
    for name, fields in structs.items():
        lines.append(f'    printf("{name} %zu", sizeof({name}));')
        for field, _ in fields:
            lines.append(f'    printf(" %zu %zu", offsetof({name}, {field}), sizeof((({name} *)0)->{field}));')
        lines.append('    printf("\\n");')
    lines += ["    return 0;", "}"]
    source, program = tmp_path / "layout.c", tmp_path / "layout"
    source.write_text("\n".join(lines) + "\n")
    subprocess.run([COMPILER, "-std=c11", f"-I{cpu_loader.CSRC_CPU}", "-o", str(program), str(source)],
                   check=True, capture_output=True, text=True)
    out = subprocess.run([str(program)], check=True, capture_output=True, text=True).stdout
    return {name: [int(n) for n in numbers] for name, *numbers in (ln.split() for ln in out.splitlines())}


def test_every_struct_has_one_structure_and_one_kernel():
    structs, kernels = _header_structs(), _header_kernels()
    assert len(structs) == len(cpu_args.ALL) >= 7
    assert sorted(structs) == sorted(cls.c_name for cls in cpu_args.ALL)
    assert kernels == {cls.kernel: cls.c_name for cls in cpu_args.ALL}


def test_every_exported_kernel_takes_its_struct():
    """Each C file's exl_* functions are the prototypes of args.h (plus the availability checks and
    the pool's start): no kernel is called with a positional argument list."""
    defined = set()
    for path in cpu_loader.CSRC_CPU.glob("*.c"):
        defined |= set(re.findall(r"^int\s+(exl_\w+)\s*\(", path.read_text(), re.M))
    kernels = {name for name in defined if not name.endswith("_available") and name != "exl_pool_start"}
    assert kernels == set(_header_kernels())


@needs_compiler
def test_the_structures_match_the_c_layout(tmp_path):
    structs = _header_structs()
    layout = _c_layout(structs, tmp_path)
    for cls in cpu_args.ALL:
        fields = structs[cls.c_name]
        assert [(name, _CTYPES_KIND[ctype]) for name, ctype in cls._fields_] == fields, cls.__name__
        expected = [ctypes.sizeof(cls)]
        for name, _ in cls._fields_:
            expected += [getattr(cls, name).offset, getattr(cls, name).size]
        assert layout[cls.c_name] == expected, f"{cls.__name__} vs {cls.c_name}: [sizeof, (offset, size)...]"


@needs_compiler
def test_the_kernels_compile_against_the_header(tmp_path):
    """Each C file with the AVX-512 paths on, so its definitions are checked against the header's
    prototypes even on a CPU that cannot run them (compiling needs no AVX-512)."""
    flags = ["-std=c11", "-fsyntax-only", "-Werror", "-Wall", "-mavx512f", "-mavx512bf16", "-mavx512bw",
             "-mavx512vl", "-mavx512dq", f"-I{cpu_loader.CSRC_CPU}"]
    for path in sorted(cpu_loader.CSRC_CPU.glob("*.c")):
        done = subprocess.run([COMPILER, *flags, str(path)], capture_output=True, text=True)
        assert done.returncode == 0, f"{path.name}: {done.stderr[:2000]}"


def test_structures_take_tensor_pointers_and_sizes():
    t = ctypes.c_int64(7)
    args = cpu_args.SiluAndMulArgs(x=ctypes.addressof(t), x_stride=2, out=None, out_stride=1, inter=1, rows=3)
    assert (args.x, args.x_stride, args.out, args.rows) == (ctypes.addressof(t), 2, None, 3)
