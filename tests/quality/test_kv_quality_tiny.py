"""The harness on a tiny random llama: exact self-agreement, sensitivity, bad input."""

import math

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from veloxquant_mlx.quality import measure_kv_quality, reference_cache, reference_run

TOKENS = [(7 * i + 3) % 97 for i in range(48)]


def _q2(model):
    return [QuantizedKVCache(group_size=32, bits=2) for _ in model.layers]


def test_reference_against_itself_is_exact(tiny_llama):
    r = measure_kv_quality(tiny_llama, TOKENS, reference_cache, n_prefill=16)
    assert (r.kl_mean, r.kl_median, r.kl_max, r.top1) == (0.0, 0.0, 0.0, 1.0)
    assert r.ppl == r.ppl_ref
    assert (r.n_positions, r.n_prefill, r.n_tokens) == (32, 16, 48)
    assert r.nbytes_after_run == r.nbytes_ref_after_run > 0


def test_ppl_ref_is_the_one_pass_perplexity(tiny_llama):
    # Teacher-forced decoding with a KVCache must give the same PPL as one forward pass.
    r = measure_kv_quality(tiny_llama, TOKENS, reference_cache, n_prefill=16)
    ids = mx.array(TOKENS)
    logits = tiny_llama(ids[None, :-1])[0]
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    one_pass = math.exp(-mx.take_along_axis(lp, ids[1:, None], axis=-1).mean().item())
    assert r.ppl_ref == pytest.approx(one_pass, rel=1e-4)


def test_two_bit_cache_differs_and_holds_fewer_bytes(tiny_llama):
    r = measure_kv_quality(tiny_llama, TOKENS, _q2, n_prefill=16)
    assert r.kl_mean > 0 and r.kl_max >= r.kl_median >= 0
    assert r.ppl != r.ppl_ref
    assert 0 < r.nbytes_after_prompt < r.nbytes_ref_after_prompt


def test_shared_reference_gives_the_same_result(tiny_llama):
    ref = reference_run(tiny_llama, TOKENS, 16)
    assert measure_kv_quality(tiny_llama, TOKENS, _q2, 16, reference=ref) == measure_kv_quality(tiny_llama, TOKENS, _q2, 16)


def test_result_is_frozen(tiny_llama):
    r = measure_kv_quality(tiny_llama, TOKENS[:8], reference_cache, n_prefill=4)
    with pytest.raises(AttributeError):
        r.kl_mean = 1.0
    assert set(r.to_dict()) >= {"kl_mean", "top1", "ppl", "ppl_ref", "n_positions", "nbytes_after_prompt"}


@pytest.mark.parametrize("n_prefill", [0, 8, 9])
def test_prefill_out_of_range_is_an_error(tiny_llama, n_prefill):
    with pytest.raises(ValueError, match=f"n_prefill is {n_prefill}; allowed: 1 <= n_prefill < len\\(tokens\\) = 8"):
        measure_kv_quality(tiny_llama, TOKENS[:8], reference_cache, n_prefill=n_prefill)


def test_wrong_number_of_caches_is_an_error(tiny_llama):
    with pytest.raises(ValueError, match="make_cache returned 1 caches; the model has 2 layers"):
        measure_kv_quality(tiny_llama, TOKENS[:8], lambda m: [KVCache()], n_prefill=4)


def test_reference_of_another_run_is_an_error(tiny_llama):
    ref = reference_run(tiny_llama, TOKENS[:8], 4)
    with pytest.raises(ValueError, match="reference was run with n_prefill=4 over 8 tokens"):
        measure_kv_quality(tiny_llama, TOKENS[:12], reference_cache, n_prefill=4, reference=ref)
