"""A K-quant version of the default model, made by our own quantizer (a Q4_K_M-style mix, see
requantize_gguf.py), loads, runs, and its perplexity agrees with the original's (fp32 activations,
the original's Q4_1 weights as they are) within the quantization error.

The bound, from the KLD: per scored token, ln PPL(Q) - ln PPL(base) averages d = ln p_base(t) -
ln p_Q(t). Were the text drawn from the base model's own predictions, the mean of d would be the mean
KL(base || Q) exactly (E_p[ln p - ln q] = KL(p || q)), up to its sampling error sigma, which is
llama.cpp's uncertainty of ln(PPL(Q)/PPL(base)). Real text is not drawn from the model, so we allow
twice the KLD: |ln(PPL(Q)/PPL(base))| <= 2 * mean KLD + 3 * sigma. Measured on tqdm's README (8
chunks of 512): mean KLD 0.0632 ± 0.0016, ln ratio 0.0686 ± 0.0087 (PPL 10.28 -> 11.01), so the ratio
does track the KLD; the test fails on a quantizer or kernel that adds error (the KLD grows past its
limit) and on a PPL that drifts where the KLD does not.
"""

from __future__ import annotations

import io
import math
from pathlib import Path

import pytest
from requantize_gguf import requantize_q4_k_m  # tests/model/requantize_gguf.py

from exlcli.bench.ppl.run import PerplexityOptions, run_perplexity
from exlcli.model.loader import load_model

# a fixed text (the README, used before, changes with every edit and its figures with it)
TEXT = Path(__file__).resolve().parents[1] / "data" / "opticks-excerpt.txt"


@pytest.mark.slow
def test_k_quant_copy_agrees_with_the_original_within_its_kld(default_model_path, tmp_path):
    copy = tmp_path / "smollm2-135m-q4_k_m.gguf"
    types = requantize_q4_k_m(default_model_path, str(copy))
    assert types["Q4_K"] > 0 and types["Q6_K"] > 0

    saved = tmp_path / "base.bin"
    options = dict(text=TEXT, ctx_size=256, max_chunks=4)
    base = run_perplexity(PerplexityOptions(**options, save_logits=saved), out=io.StringIO(), log=io.StringIO(),
                          loaded=load_model(default_model_path, device="cpu", dtype="float32"))
    quant = load_model(str(copy), device="cpu", dtype="float32")
    assert {"Q4_K", "Q6_K", "Q5_0"} <= set(quant.quantization.split("+"))
    out = io.StringIO()
    result = run_perplexity(PerplexityOptions(**options, kl_divergence=saved), out=out, log=io.StringIO(),
                            loaded=quant)
    kld = result.kld
    mean_kld, _ = kld.kld()
    ratio, sigma = kld.log_ppl_ratio()
    facts = (f"PPL base {base.stats.ppl:.4f}, Q {result.stats.ppl:.4f}, ln ratio {ratio:.5f} ± {sigma:.5f}, "
             f"mean KLD {mean_kld:.5f}, same top {kld.same_top()[0]:.2%}\n{out.getvalue()}")
    assert 0 < mean_kld < 0.15, facts  # measured 0.063 over 8 chunks of 512 of a README
    assert kld.same_top()[0] > 0.8, facts  # measured 87%
    assert abs(ratio) <= 2 * mean_kld + 3 * sigma, facts
    assert abs(math.log(result.stats.ppl / base.stats.ppl)) <= 2 * mean_kld + 3 * sigma, facts
