"""integration.fork: a copy of a prompt-filled cache list continues exactly as a list with its
own prefill, even while the original continues in between (no array shared between the two)."""

import mlx.core as mx
import pytest

from veloxquant_mlx.bench.tiny import random_llama
from veloxquant_mlx.config import KVCacheConfig
from veloxquant_mlx.errors import QuantizerConfigError
from veloxquant_mlx.integration import patch_model_kv_cache, unpatch_model_kv_cache
from veloxquant_mlx.integration.fork import fork_caches


@pytest.fixture
def tiny():
    return random_llama(hidden=128, layers=2, heads=2, kv_heads=1, head_dim=64, intermediate=256, vocab=256)


def _prefilled(model, prompt):
    caches = model.make_cache()
    logits = model(mx.array([prompt], dtype=mx.int32), cache=caches)[:, -1, :]
    mx.eval(logits)
    return caches


def _step(model, caches, token):
    logits = model(mx.array([[token]], dtype=mx.int32), cache=caches)[:, -1, :]
    mx.eval(logits)
    return logits


@pytest.mark.parametrize("method", ["kivi", "xquant", "kvquant"])
def test_a_fork_continues_as_its_own_prefill_while_the_original_runs_in_between(tiny, method):
    prompt = [(i * 37 + 11) % 256 for i in range(300)]
    mine = [(i * 13 + 5) % 256 for i in range(70)]  # 70 steps: block flushes written in place
    theirs = [(i * 29 + 1) % 256 for i in range(70)]
    patch_model_kv_cache(tiny, KVCacheConfig.from_dict({"method": method}))
    try:
        original = _prefilled(tiny, prompt)
        fork = fork_caches(original)
        alone, original_alone = _prefilled(tiny, prompt), _prefilled(tiny, prompt)
        for a, b in zip(theirs, mine):
            # Each one's block writes land between the other's steps, in both orders.
            assert mx.array_equal(_step(tiny, fork, b), _step(tiny, alone, b)).item()
            assert mx.array_equal(_step(tiny, original, a), _step(tiny, original_alone, a)).item()
    finally:
        unpatch_model_kv_cache(tiny)


def test_only_our_caches_are_forked(tiny):
    with pytest.raises(QuantizerConfigError, match="entry 0 is KVCache"):
        fork_caches(tiny.make_cache())
