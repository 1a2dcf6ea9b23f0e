"""Test helper: a Hugging Face folder converted to GGUF by llama.cpp's own convert_hf_to_gguf.py (the
tree in ../shared/peers/llama.cpp beside the checkout), so the loader meets the tensor layouts
llama.cpp really writes.

The tiny test tokenizers are no tokenizer llama.cpp knows by its fingerprint, so the converter's
pre-tokenizer lookup is answered "default" (the tensors, metadata and vocabulary are converted as
for any model).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LLAMA_CPP = ROOT.parent / "shared" / "peers" / "llama.cpp"

_RUNNER = """
import runpy, sys
root = sys.argv[1]
sys.path[:0] = [root, root + "/gguf-py"]
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
sys.argv = [root + "/convert_hf_to_gguf.py"] + sys.argv[2:]
runpy.run_path(root + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def convert(folder: Path, out: Path, outtype: str = "f32") -> Path:
    return convert_args(folder, out, [], outtype)


def convert_args(folder: Path, out: Path, args: list[str], outtype: str = "f32") -> Path:
    """convert() with more of the converter's options (e.g. --no-mtp)."""
    if not (LLAMA_CPP / "convert_hf_to_gguf.py").is_file():
        pytest.skip(f"llama.cpp's converter is not at {LLAMA_CPP}")
    done = subprocess.run([sys.executable, "-c", _RUNNER, str(LLAMA_CPP), str(folder), "--outtype", outtype,
                           "--outfile", str(out), *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return out
