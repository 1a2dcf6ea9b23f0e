"""`exlcli perplexity`'s library: the PPL and KLD equal straightforward computations on a tiny random
model, chunking the prefill changes nothing, the saved log-probs keep llama.cpp's layout, and a
mismatched file or text is refused with one clear line."""

from __future__ import annotations

import io
import math
import re
import struct

import numpy as np
import pytest
import torch
from ppl_models import TEXT, BosTokenizer, tiny_model  # tests/bench/ppl_models.py

from exlcli.bench.ppl.chunks import plan_chunks
from exlcli.bench.ppl.forward import ChunkRunner
from exlcli.bench.ppl.logits_file import (
    LogitsFileError,
    LogitsHeader,
    LogitsReader,
    decode_rows,
    encode_rows,
    row_width,
)
from exlcli.bench.ppl.run import PerplexityOptions, run_perplexity
from exlcli.bench.ppl.stats import median, percentile
from exlcli.errors import ExlcliError
from exlcli.model.batch_inputs import BatchInputs
from exlcli.model.kv_cache import KVCache

N_CTX = 64


@pytest.fixture(scope="module")
def base():
    return tiny_model()


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(TEXT)
    return path


def run(loaded, text, **kw):
    out = io.StringIO()
    result = run_perplexity(PerplexityOptions(text=text, **{"ctx_size": N_CTX, **kw}), out=out, log=io.StringIO(),
                            loaded=loaded)
    return result, out.getvalue()


def full_chunk_logits(loaded, ids: list[int]) -> torch.Tensor:
    """Every position's logits of one sequence in one forward pass: [n, V]."""
    n = len(ids)
    kv = KVCache(loaded.config, n, 1, torch.device("cpu"), torch.float32)  # one page per token
    pos = torch.arange(n)
    batch = BatchInputs(input_ids=torch.tensor(ids), positions=pos, slot_mapping=pos,
                        block_tables=torch.arange(n, dtype=torch.int32)[None], seq_lens=[n],
                        query_start_loc=[0, n], logits_indices=pos)
    return loaded.model.forward(batch, kv)


def direct_nlls(loaded, tokens: list[int], n_ctx: int, num_chunks: int, bos: int | None = None) -> torch.Tensor:
    """The NLLs of the second half of each chunk, from one full forward per chunk."""
    nlls = []
    for c in range(num_chunks):
        chunk = tokens[c * n_ctx:(c + 1) * n_ctx]
        inputs = [bos, *chunk[1:]] if bos is not None else chunk
        log_probs = torch.log_softmax(full_chunk_logits(loaded, inputs), dim=-1)
        for pos in range(n_ctx // 2, n_ctx - 1):
            nlls.append(-log_probs[pos, chunk[pos + 1]].item())
    return torch.tensor(nlls, dtype=torch.float64)


def test_ppl_equals_one_full_forward_per_chunk(base, text_file):
    result, out = run(base, text_file, max_chunks=5)
    nlls = direct_nlls(base, base.tokenizer.encode(TEXT), N_CTX, 5)
    assert result.stats.count == nlls.numel() == 5 * (N_CTX - 1 - N_CTX // 2)
    ppl = math.exp(nlls.mean().item())
    assert result.stats.ppl == pytest.approx(ppl, rel=1e-4)
    error = ppl * nlls.std().item() / math.sqrt(nlls.numel())  # the standard error of the mean NLL, through exp
    assert result.stats.ppl_error() == pytest.approx(error, rel=1e-4)
    final = re.search(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", out)
    assert float(final[1]) == pytest.approx(ppl, rel=1e-4) and float(final[2]) == pytest.approx(error, rel=1e-3)
    per_chunk = re.findall(r"\[(\d)\]([\d.]+),", out)
    assert [int(n) for n, _ in per_chunk] == [1, 2, 3, 4, 5]
    first_chunk = math.exp(nlls[:N_CTX - 1 - N_CTX // 2].mean().item())
    assert float(per_chunk[0][1]) == pytest.approx(first_chunk, rel=1e-4)


def test_every_chunk_that_fits_by_default(base, text_file):
    result, _ = run(base, text_file)
    assert result.plan.num_chunks == len(TEXT) // N_CTX


def test_bos_replaces_each_chunks_first_token(text_file):
    loaded = tiny_model(tokenizer=BosTokenizer(512))
    tokens = loaded.tokenizer.encode(TEXT)
    assert tokens[0] == 1 and len(tokens) == len(TEXT) + 1
    result, _ = run(loaded, text_file, max_chunks=3)
    with_bos = direct_nlls(loaded, tokens, N_CTX, 3, bos=1)
    assert result.stats.ppl == pytest.approx(math.exp(with_bos.mean().item()), rel=1e-4)
    without = direct_nlls(loaded, tokens, N_CTX, 3)
    assert abs(math.exp(without.mean().item()) / result.stats.ppl - 1) > 1e-3  # the test can tell them apart


@pytest.mark.parametrize("ubatch", [5, 32, 33, 63])
def test_chunked_prefill_gives_the_nll_of_one_piece(base, ubatch):
    ids = base.tokenizer.encode(TEXT)[:N_CTX]
    first, last = N_CTX // 2, N_CTX - 2
    whole = torch.cat(list(ChunkRunner(base.model, N_CTX, N_CTX).logits(ids, first, last)))
    pieces = list(ChunkRunner(base.model, N_CTX, ubatch).logits(ids, first, last))
    assert len(pieces) == -(-(last + 1) // ubatch) - first // ubatch  # only pieces holding scored rows
    chunked = torch.cat(pieces)
    assert chunked.shape == whole.shape == (last - first + 1, base.config.vocab_size)
    # fp32 noise only: a chunk of up to 8 queries attends row by row (decode rows' bits), a longer one
    # in one product, so the sums round in other orders (log-probs near -6: 1e-6 relative)
    torch.testing.assert_close(torch.log_softmax(chunked, -1), torch.log_softmax(whole, -1), rtol=1e-5, atol=1e-5)


def test_a_chunk_does_not_see_the_one_before(base):
    """The KV pages are reused: each chunk's logits are those of a fresh cache."""
    ids = base.tokenizer.encode(TEXT)
    runner = ChunkRunner(base.model, N_CTX, 16)
    list(runner.logits(ids[N_CTX:2 * N_CTX], 0, N_CTX - 2))
    again = torch.cat(list(runner.logits(ids[:N_CTX], N_CTX // 2, N_CTX - 2)))
    fresh = torch.cat(list(ChunkRunner(base.model, N_CTX, 16).logits(ids[:N_CTX], N_CTX // 2, N_CTX - 2)))
    assert torch.equal(again, fresh)


# --- the saved log-probs and the KL divergence ----------------------------------------------------

def test_saved_rows_hold_the_log_probs_to_half_a_step():
    logits = torch.randn(7, 301) * 4
    logits[3] = 0.0  # all equal: no range (scale 0)
    rows = encode_rows(logits)
    assert rows.shape == (7, row_width(301)) == (7, 306) and rows.dtype == np.uint16
    back = decode_rows(rows, 301)
    exact = torch.log_softmax(logits, -1)
    kept = exact > exact.amax(-1, keepdim=True) - 16
    step = (16 / 65535)
    assert (back - exact)[kept].abs().max() <= step / 2 + 1e-5
    assert torch.equal(back.argmax(-1), logits.argmax(-1))


def test_the_file_has_llama_perplexitys_layout(base, text_file, tmp_path):
    saved = tmp_path / "base.bin"
    result, _ = run(base, text_file, max_chunks=3, save_logits=saved)
    data = saved.read_bytes()
    n_vocab = base.config.vocab_size
    assert data[:8] == b"_logits_" and struct.unpack("<iii", data[8:20]) == (N_CTX, n_vocab, 3)
    tokens = np.frombuffer(data[20:20 + 4 * 3 * N_CTX], dtype="<i4").tolist()
    assert tokens == base.tokenizer.encode(TEXT)[:3 * N_CTX]
    header = LogitsHeader(N_CTX, n_vocab, 3)
    assert len(data) > header.size_without_trailer() and data.endswith(b"_exlcli_")
    reader = LogitsReader(saved)
    assert reader.header.model == base.name and reader.header.n_chunk == 3
    # the first saved row: chunk 0's log-probs at position n_ctx / 2
    row = np.frombuffer(data, dtype="<u2", count=row_width(n_vocab), offset=20 + 4 * 3 * N_CTX)[None]
    exact = torch.log_softmax(full_chunk_logits(base, tokens[:N_CTX])[N_CTX // 2], -1)
    assert (decode_rows(row, n_vocab)[0] - exact).abs().max() < 2e-4


def test_a_file_without_our_trailer_reads_as_llama_cpps(base, text_file, tmp_path):
    saved = tmp_path / "base.bin"
    run(base, text_file, max_chunks=2, save_logits=saved)
    size = LogitsHeader(N_CTX, base.config.vocab_size, 2).size_without_trailer()
    saved.write_bytes(saved.read_bytes()[:size])
    assert LogitsReader(saved).header.model.startswith("unknown")
    result, _ = run(base, text_file, kl_divergence=saved)
    assert result.kld.count == 2 * (N_CTX - 1 - N_CTX // 2)


def test_kld_of_a_run_against_itself_is_zero(base, text_file, tmp_path):
    saved = tmp_path / "base.bin"
    reference, _ = run(base, text_file, save_logits=saved)
    result, out = run(base, text_file, kl_divergence=saved)
    kld = result.kld
    assert kld.count == reference.stats.count >= 100
    assert abs(kld.kld()[0]) < 1e-5 and float(kld.sorted_kld().abs().max()) < 1e-3
    assert kld.same_top()[0] == 1.0
    assert abs(kld.log_ppl_ratio()[0]) < 1e-4 and abs(kld.p_diff()[0]) < 1e-5
    assert result.stats.ppl == pytest.approx(reference.stats.ppl, rel=1e-6)
    assert "Same top p: 100.000 ± 0.000 %" in out and "Mean    KLD:" in out


def test_kld_against_a_perturbed_model(base, text_file, tmp_path):
    saved = tmp_path / "base.bin"
    run(base, text_file, save_logits=saved)
    perturbed = tiny_model(noise=0.05)
    result, out = run(perturbed, text_file, kl_divergence=saved)
    kld = result.kld
    # the same numbers straight from both models' full-precision logits
    plan = plan_chunks(base.tokenizer.encode(TEXT), N_CTX, None, None)
    klds, same, nll, nll_base = [], [], [], []
    for c in range(plan.num_chunks):
        p_log = torch.log_softmax(full_chunk_logits(base, plan.chunk(c)), -1)[N_CTX // 2:N_CTX - 1]
        q_log = torch.log_softmax(full_chunk_logits(perturbed, plan.chunk(c)), -1)[N_CTX // 2:N_CTX - 1]
        klds.append((p_log.exp() * (p_log - q_log)).sum(-1))
        same.append(p_log.argmax(-1) == q_log.argmax(-1))
        targets = torch.tensor(plan.targets(c))[:, None]
        nll.append(-q_log.gather(1, targets)[:, 0])
        nll_base.append(-p_log.gather(1, targets)[:, 0])
    klds, same = torch.cat(klds).double(), torch.cat(same)
    assert kld.kld()[0] > 0.01
    assert kld.kld()[0] == pytest.approx(klds.mean().item(), abs=2e-4)
    assert kld.kld()[1] == pytest.approx(klds.std().item() / math.sqrt(klds.numel()), rel=2e-2)
    assert kld.same_top()[0] == pytest.approx(same.float().mean().item(), abs=1.5 / same.numel())
    ratio = torch.cat(nll).double().mean() - torch.cat(nll_base).double().mean()
    assert kld.log_ppl_ratio()[0] == pytest.approx(ratio.item(), abs=2e-4)
    assert median(kld.sorted_kld()) == pytest.approx(klds.median().item(), abs=0.02)
    for line in ("Mean PPL(Q)/PPL(base)", "Mean    KLD:", "99.0%   KLD:", "Median  KLD:", "Same top p:", "Mean    Δp:"):
        assert line in out


def test_percentile_as_llama_cpp():
    values = torch.tensor([0.0, 1.0, 2.0, 3.0, 10.0])
    assert percentile(values, 0.5) == 2.0 and percentile(values, 0.99) == pytest.approx(3 + 0.96 * 7)
    assert percentile(values, 0.0) == 0.0 and percentile(values, 1.0) == 10.0
    assert median(values) == 2.0 and median(values[:4]) == 1.5


# --- bad input: one clear line each ----------------------------------------------------------------

def test_text_shorter_than_two_contexts(base, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text(TEXT[:2 * N_CTX - 1])
    with pytest.raises(ExlcliError, match=f"you need at least {2 * N_CTX} tokens .* context of {N_CTX}; "
                                          f"the text tokenizes to only {2 * N_CTX - 1} tokens"):
        run(base, short)


def test_missing_text_file(base, tmp_path):
    with pytest.raises(ExlcliError, match="no such text file"):
        run(base, tmp_path / "nope.txt")


def test_ctx_size_above_the_models_context(base, text_file):
    with pytest.raises(ExlcliError, match="--ctx-size 8192 is above the model's context of 4096 tokens"):
        run(base, text_file, ctx_size=8192)


@pytest.fixture(scope="module")
def saved_reference(base, tmp_path_factory):
    folder = tmp_path_factory.mktemp("ref")
    (folder / "text.txt").write_text(TEXT)
    run(base, folder / "text.txt", max_chunks=4, save_logits=folder / "base.bin")
    return folder / "base.bin"


def test_another_vocabulary_is_refused(text_file, saved_reference):
    with pytest.raises(LogitsFileError, match="vocabulary of 512 tokens .* has 300"):
        run(tiny_model(vocab_size=300), text_file, kl_divergence=saved_reference)


def test_another_ctx_size_is_refused(base, text_file, saved_reference):
    with pytest.raises(LogitsFileError, match="saved with --ctx-size 64; this run asks for 32"):
        run(base, text_file, ctx_size=32, kl_divergence=saved_reference)


def test_another_text_is_refused(base, tmp_path, saved_reference):
    other = tmp_path / "other.txt"
    other.write_text(TEXT[::-1])
    with pytest.raises(LogitsFileError, match="does not tokenize to the tokens saved in"):
        run(base, other, kl_divergence=saved_reference)


def test_more_chunks_than_saved_are_refused_and_fewer_compare_a_prefix(base, text_file, saved_reference):
    with pytest.raises(LogitsFileError, match="holds 4 chunks; --chunks 5 asks for more"):
        run(base, text_file, max_chunks=5, kl_divergence=saved_reference)
    result, _ = run(base, text_file, max_chunks=2, kl_divergence=saved_reference)
    assert result.kld.count == 2 * (N_CTX - 1 - N_CTX // 2)


def test_without_the_text_the_saved_tokens_are_used(base, saved_reference):
    result, _ = run(base, None, kl_divergence=saved_reference, ctx_size=None)
    assert result.plan.num_chunks == 4 and abs(result.kld.kld()[0]) < 1e-5


def test_not_a_logits_file_and_a_truncated_one(base, text_file, saved_reference, tmp_path):
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"hello world, not logits")
    with pytest.raises(LogitsFileError, match="does not look like a file of log-probabilities"):
        run(base, text_file, kl_divergence=junk)
    cut = tmp_path / "cut.bin"
    cut.write_bytes(saved_reference.read_bytes()[:5000])
    with pytest.raises(LogitsFileError, match="is truncated: 5000 bytes"):
        run(base, text_file, kl_divergence=cut)
    with pytest.raises(LogitsFileError, match="no such logits file"):
        run(base, text_file, kl_divergence=tmp_path / "absent.bin")


def test_save_and_compare_together_are_refused(base, text_file, saved_reference, tmp_path):
    with pytest.raises(ExlcliError, match="do not go together"):
        run(base, text_file, save_logits=tmp_path / "x.bin", kl_divergence=saved_reference)


# --- the default model ------------------------------------------------------------------------------

@pytest.mark.slow
def test_default_model_ppl_of_the_readme_equals_transformers(default_model_path):
    """SmolLM2-135M on this repository's README: our PPL is what transformers' own forward of the same
    GGUF (dequantized to fp32 by its converter) gives on the same chunks, and in a sane range
    (measured 57 over the first two chunks of 256: dense jargon, little context; tqdm's README gives
    10 at 512; a uniform guess is 49,152)."""
    import os
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from exlcli.model.loader import load_model

    readme = Path(__file__).resolve().parents[2] / "README.md"
    loaded = load_model(default_model_path, device="cpu", dtype="float32")
    result, out = run(loaded, readme, ctx_size=256, max_chunks=2)
    assert result.stats.count == 2 * 127
    assert 5 < result.stats.ppl < 200, out
    assert 0 < result.stats.ppl_error() < result.stats.ppl / 2

    folder, name = os.path.split(default_model_path)
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    nlls = []
    for c in range(2):
        ids = result.plan.chunk(c)
        with torch.no_grad():
            log_probs = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
        nlls += [-log_probs[pos, ids[pos + 1]].item() for pos in range(128, 255)]
    assert result.stats.ppl == pytest.approx(math.exp(sum(nlls) / len(nlls)), rel=1e-3)
