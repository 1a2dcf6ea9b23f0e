"""TokenEmbedding (exlcli/ops/embedding.py): on the CPU a GGUF-quantized table stays in its blocks and the looked-up
rows equal the dense table's rows bit for bit; elsewhere, and for formats the C code does not read, it is dense."""

import pytest
import torch
import torch.nn.functional as F
from test_c_repack import random_blocks

from exlcli.ops.embedding import TokenEmbedding
from exlcli.ops.formats import QuantizedWeight
from exlcli.ops.formats.cpu_qmatmul import C_REPACKED, available

CPU = torch.device("cpu")


@pytest.mark.skipif(not available(), reason="CPU kernels not built here")
@pytest.mark.parametrize("qtype", sorted(C_REPACKED))
def test_quantized_rows_equal_the_dense_tables_rows(qtype, monkeypatch):
    w = random_blocks(qtype, 40, 512, seed=3)
    table = w.dequantize(torch.bfloat16)
    monkeypatch.setattr(QuantizedWeight, "dequantize", lambda *a: pytest.fail("the whole table dequantized"))
    embedding = TokenEmbedding(w, torch.bfloat16, CPU)
    assert embedding.dense is None and embedding.nbytes() == w.nbytes() < table.numel() * 2
    ids = torch.tensor([[39, 0, 7, 7], [1, 2, 3, 38]])
    got = embedding(ids)
    assert got.shape == (2, 4, 512) and got.dtype == torch.bfloat16
    assert torch.equal(got.view(torch.int16), F.embedding(ids, table).view(torch.int16))
    assert embedding(torch.tensor([], dtype=torch.long)).shape == (0, 512)


@pytest.mark.skipif(not available(), reason="CPU kernels not built here")
@pytest.mark.parametrize("bad", [40, -1])
def test_an_id_outside_the_table_is_an_index_error(bad):
    embedding = TokenEmbedding(random_blocks("Q8_0", 40, 256, seed=4), torch.bfloat16, CPU)
    with pytest.raises(IndexError, match="40 rows"):
        embedding(torch.tensor([0, bad]))


def test_a_dense_table_is_shared_as_it_is():
    table = torch.randn(10, 16, dtype=torch.bfloat16)
    embedding = TokenEmbedding(table, torch.bfloat16, CPU)
    assert embedding.dense is table and embedding.quantized is None and embedding.nbytes() == 320
    ids = torch.tensor([3, 9])
    assert torch.equal(embedding(ids), table[ids])


def test_a_format_the_c_code_does_not_read_is_dequantized_once():
    w = random_blocks("Q4_K", 8, 256, seed=5)
    w = QuantizedWeight(w.fmt, w.shape, w.blocks, input_order=torch.arange(256).flip(0))  # as GPTQ's act order
    embedding = TokenEmbedding(w, torch.bfloat16, CPU)
    assert embedding.quantized is None and embedding.dense is not None and embedding.dense.shape == (8, 256)
