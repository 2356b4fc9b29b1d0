"""GEARCache through mlx-lm's own paths on a tiny random llama: patched generate, the prompt
cache file round trip, and trim."""

from functools import partial

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache, trim_prompt_cache

from veloxquant_mlx import KVCacheBuilder, KVCacheConfig, patch_model_kv_cache, unpatch_model_kv_cache
from veloxquant_mlx.cache.gear import GEARCache
from tests.integration.decode_spy import assert_decode_steps_never_decoded, spy_history_decodes
from tests.integration.tiny_llama import greedy_tokens, tiny_llama

CONFIG = KVCacheConfig(method="gear", gear_bits=2)
PROMPT = mx.array([(i * 7) % 64 for i in range(560)])  # two whole blocks of 256 + a window
_tokens = partial(greedy_tokens, prompt=PROMPT, n=24)


@pytest.fixture
def model():
    m = tiny_llama()
    yield m
    unpatch_model_kv_cache(m)


def test_patched_generate_matches_attention_over_the_decoded_history(model, monkeypatch):
    # Unpatched: mlx-lm attends over the K/V our caches decode -- the reference.
    dequantized = _tokens(model, KVCacheBuilder.for_model(model, CONFIG))
    step_rows, decodes = spy_history_decodes(monkeypatch, GEARCache)
    first = patch_model_kv_cache(model, CONFIG)
    assert all(type(c) is GEARCache for c in first)
    assert _tokens(model) == dequantized
    assert_decode_steps_never_decoded(step_rows, decodes, GEARCache, min_steps=2 * 23)


def test_save_and_load_prompt_cache_give_the_same_next_tokens(model, tmp_path):
    cache = patch_model_kv_cache(model, CONFIG)
    for _ in generate_step(PROMPT, model, max_tokens=1, prompt_cache=cache, prefill_step_size=128):
        pass
    assert cache[0].n_compressed == 512
    path = str(tmp_path / "gear.safetensors")
    save_prompt_cache(path, cache)
    loaded = load_prompt_cache(path)
    assert all(type(c) is GEARCache for c in loaded)
    assert loaded[0].offset == cache[0].offset and loaded[0].nbytes == cache[0].nbytes
    follow = mx.array([5, 9, 13])
    assert _tokens(model, loaded, prompt=follow, n=8) == _tokens(model, cache, prompt=follow, n=8)


def test_trim_prompt_cache_then_continue(model):
    cache = patch_model_kv_cache(model, CONFIG)
    model(PROMPT[None], cache=cache)
    assert cache[0].n_compressed == 512
    before = [c._full_keys_values() for c in cache]
    assert trim_prompt_cache(cache, 260) == 260  # into the second block: it is re-opened
    assert cache[0].offset == 300 and cache[0].n_compressed == 256
    for c, (keys, values) in zip(cache, before):
        k, v = c._full_keys_values()
        assert mx.allclose(k, keys[:, :, :300], atol=1e-5).item()
        assert mx.allclose(v, values[:, :, :300], atol=1e-5).item()
    assert len(_tokens(model, cache, prompt=mx.array([3]), n=4)) == 4
