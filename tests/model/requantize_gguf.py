"""Test helper: a GGUF model file requantized to a Q4_K_M-style mix by our own quantizer (every tensor
dequantized to fp32 by the gguf package, then each 2-D weight quantized to the type `q4_k_m_type`
picks), with every metadata key of the source copied, so the copy loads and tokenizes as the source.
`requantize` takes any choice of types (scripts/small_moe_gguf.py's one type for every weight, for one),
and may rewrite the tensors first (`edit`: an older converter's layout, for one).

For the default model (SmolLM2-135M, 576 wide) this is the mix llama.cpp's Q4_K_M makes of it: the
ffn_down weights (1536 wide) become Q4_K / Q6_K, the 576-wide rows fall back to Q5_0 / Q8_0.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import gguf
import numpy as np
from kquant_gguf import TypeOf, q4_k_m_type, quantize_tensors  # tests/model/kquant_gguf.py

WRITER_KEYS = ("GGUF.", "general.architecture")  # the writer writes these itself


def requantize_q4_k_m(source: str, target: str) -> Counter:
    """Write `target`, the model in `source` requantized; returns the count of each tensor type."""
    fields = gguf.GGUFReader(source).fields
    num_layers = int(fields[f"{fields['general.architecture'].contents()}.block_count"].contents())
    return requantize(source, target, lambda name, data: q4_k_m_type(name, data, num_layers),
                      int(gguf.LlamaFileType.MOSTLY_Q4_K_M))


def requantize(source: str, target: str, type_of: TypeOf, file_type: int,
               edit: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]] | None = None) -> Counter:
    """Write `target`, the model in `source` with each tensor in the type `type_of` picks (stacked experts
    too), every metadata key copied and general.file_type set to `file_type`; returns the count of each type.
    `edit` rewrites the fp32 tensors (GGUF name -> array, in the file's order) before they are quantized."""
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(target, reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith(WRITER_KEYS):
            continue
        value = field.contents()
        if key == "general.file_type":
            value = file_type
        sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], sub_type=sub_type)
    dense = {}
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists the row length first
        dense[t.name] = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(shape).astype(np.float32)
    if edit is not None:
        dense = edit(dense)
    raw = quantize_tensors(dense, type_of)
    for name, data in dense.items():
        if name in raw:
            writer.add_tensor(name, raw[name][0], raw_dtype=raw[name][1])
        else:
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Counter(raw[name][1].name if name in raw else "F32" for name in dense)
