#!/usr/bin/env bash
# Builds exlcli's wheel, installs it alone into a fresh venv and checks, from outside the source
# tree, that the installed package carries every kernel source and that the kernels build from there:
# the CPU library builds and loads (its kernels run on a CPU with AVX2 and FMA, some only with AVX-512; elsewhere it says
# why not), and on a CUDA machine the CUDA loader finds its sources. CI runs it before the tests.
#
# Usage: bash scripts/wheel_check.sh [extra `pip wheel` options, e.g. --no-build-isolation offline]
# The venv sees the system's packages (torch is not installed again), but exlcli only from the wheel.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# Build from a copy of what git would ship (tracked and untracked-not-ignored files): the source
# tree gets no build/ or egg-info, and a kernel file git does not know cannot hide a missing glob.
mkdir "$work/src"
if git -C "$repo" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  git -C "$repo" ls-files -z --cached --others --exclude-standard | (cd "$repo" && xargs -0 cp --parents -t "$work/src" || true)
else  # a copy without git: all of it but what builds leave behind
  tar -C "$repo" --exclude=.git --exclude=build --exclude='*.egg-info' --exclude=__pycache__ -cf - . | tar -C "$work/src" -xf -
fi
[ -f "$work/src/pyproject.toml" ] || { echo "wheel_check: could not copy the source tree" >&2; exit 1; }
(cd "$work/src" && python3 -m pip wheel -q --no-deps -w "$work/dist" "$@" .)
wheel=("$work"/dist/exlcli-*.whl)

python3 -m venv --system-site-packages "$work/venv"
# where python3 is itself a venv, --system-site-packages reaches only its base: let the new venv see
# python3's own packages too (after its own, so exlcli still comes from the wheel)
python3 -c 'import site; print("\n".join(site.getsitepackages()))' \
  >"$("$work/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/_outer_site.pth"
"$work/venv/bin/python" -m pip install -q --no-deps --ignore-installed "${wheel[0]}"

cd "$work"  # nothing here is importable as exlcli: only the venv's copy is
EXLCLI_KERNEL_CACHE="$work/kernels" "$work/venv/bin/python" - "$work/src" <<'EOF'
import re
import sys
from pathlib import Path

import exlcli

source_tree = Path(sys.argv[1])
package = Path(exlcli.__file__).resolve().parent
venv = Path(sys.prefix).resolve()
assert package.is_relative_to(venv), f"exlcli was imported from {package}, not from the venv {venv}"
print(f"wheel_check: exlcli {package}")

# every kernel source of the tree is in the installed package
kinds = {".c", ".h", ".cu", ".cuh", ".cpp"}
wanted = sorted(p.relative_to(source_tree) for p in (source_tree / "exlcli" / "csrc").rglob("*") if p.suffix in kinds)
missing = [str(p) for p in wanted if not (package.parent / p).is_file()]
assert wanted and not missing, f"the wheel lacks kernel sources: {missing or 'none found in the tree'}"
print(f"wheel_check: {len(wanted)} kernel sources installed")

# the CPU kernels: the library builds from the installed sources on any CPU; they run where it has
# the instructions they need
from exlcli.ops.cpu import loader as cpu_loader  # noqa: E402

assert cpu_loader.CSRC_CPU.is_relative_to(package), cpu_loader.CSRC_CPU
library = cpu_loader.lib()
assert library is not None, f"the CPU kernel library did not build from the installed sources: {cpu_loader.reason()}"
checks = sorted({name for path in cpu_loader.CSRC_CPU.glob("*.c")
                 for name in re.findall(r"^int (exl_\w+_available)\(void\)", path.read_text(), re.M)})
available = {name: bool(getattr(library, name)()) for name in checks}
try:
    cpu_flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")).split()
except (OSError, StopIteration):
    cpu_flags = []
has_bf16 = {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= set(cpu_flags)
has_avx2 = {"avx2", "fma", "f16c"} <= set(cpu_flags)
# AVX-512 BF16 runs every kernel; AVX2 + FMA every one but paged attention (AVX-512 only so far)
want = set(checks) if has_bf16 else set(checks) - {"exl_paged_attention_available"} if has_avx2 else set()
missing = sorted(name for name in want if not available[name])
assert not missing, f"CPU kernels unavailable on a CPU with {'AVX-512 BF16' if has_bf16 else 'AVX2'}: {missing}"
if available["exl_norm_available"]:
    import torch

    from exlcli.ops import norm

    x, w = torch.randn(3, 64, dtype=torch.bfloat16), torch.randn(64, dtype=torch.bfloat16)
    assert torch.equal(norm.rms_norm_cpu(x, w, 1e-5), norm.rms_norm_ref(x, w, 1e-5)), "rms_norm_cpu differs"
ran = [name.removeprefix("exl_").removesuffix("_available") for name in checks if available[name]]
off = [name.removeprefix("exl_").removesuffix("_available") for name in checks if not available[name]]
print(f"wheel_check: CPU kernels built and loaded; running here: {', '.join(ran) or 'none'}; "
      f"without the instructions they need here (the torch reference runs): {', '.join(off) or 'none'}")

# the CUDA kernels: found by their loader inside the package (built on first use on a GPU)
import torch  # noqa: E402

from exlcli.ops.cuda import build as cuda_build  # noqa: E402 (the module that lists the CUDA build's sources)

assert cuda_build.CSRC.is_relative_to(package), cuda_build.CSRC
lost = [name for name in cuda_build.SOURCES + cuda_build.HEADERS if not (cuda_build.CSRC / name).is_file()]
assert not lost, f"the CUDA build's sources are missing: {lost}"
where = "on this CUDA machine" if torch.cuda.is_available() else "(no CUDA here: not built)"
print(f"wheel_check: the CUDA build finds its {len(cuda_build.SOURCES)} sources {where}")
print("wheel_check: ok")
EOF
