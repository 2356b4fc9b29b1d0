"""patch_model_kv_cache on a tiny random mlx-lm llama, through mlx_lm's own generate paths."""

from functools import partial

import mlx.core as mx
import mlx_lm.models.base as mlx_base
import mlx_lm.models.llama as mlx_llama
import pytest
from mlx_lm.generate import generate, generate_step
from mlx_lm.models.cache import (
    KVCache,
    QuantizedKVCache,
    load_prompt_cache,
    save_prompt_cache,
    trim_prompt_cache,
)

import veloxquant_mlx.cache.base as cache_base
from veloxquant_mlx import (
    KVCacheBuilder,
    KVCacheConfig,
    QuantizerConfigError,
    patch_model_kv_cache,
    patch_vlm_kv_cache,
    unpatch_model_kv_cache,
)
from veloxquant_mlx.cache.kivi import KIVICache
from tests.integration.decode_spy import assert_decode_steps_never_decoded, spy_history_decodes
from tests.integration.tiny_llama import CharTokenizer, greedy_tokens, tiny_llama

CONFIG = KVCacheConfig(method="kivi", bit_width_inlier=2, kivi_residual_length=32)
PROMPT = mx.array([(i * 7) % 64 for i in range(300)])
_tokens = partial(greedy_tokens, prompt=PROMPT, n=40)


@pytest.fixture
def model():
    m = tiny_llama()
    yield m
    unpatch_model_kv_cache(m)


def test_patched_generate_matches_the_dequantized_path_and_decode_never_decodes(model, monkeypatch):
    # Unpatched attention over the K/V our caches decode: the reference.
    dequantized = _tokens(model, KVCacheBuilder.for_model(model, CONFIG))
    step_rows, decodes = spy_history_decodes(monkeypatch, KIVICache)
    first = patch_model_kv_cache(model, CONFIG)
    assert [type(c) for c in first] == [KIVICache, KIVICache]
    patched = _tokens(model)  # mlx-lm calls model.make_cache() itself
    assert patched == dequantized
    # Prefill chunks decode one layer's history transiently; no decode step ever does.
    assert decodes
    assert_decode_steps_never_decoded(step_rows, decodes, KIVICache, min_steps=2 * 39)
    # Without the prefill path nothing is ever decoded, and the tokens are the same.
    decodes.clear()
    monkeypatch.setattr(KIVICache, "prefill_rows", None)
    assert _tokens(model) == patched
    assert decodes == []
    # Plain fp16 KVCache gives something else at 2 bits: the cache is really in the loop.
    unpatch_model_kv_cache(model)
    assert _tokens(model) != patched


def test_every_generate_gets_fresh_caches_and_the_first_list_is_returned(model):
    first = patch_model_kv_cache(model, CONFIG)
    a, b = model.make_cache(), model.make_cache()
    assert a[0] is not b[0] and first[0] is not a[0] and a[0].empty()
    tokenizer = CharTokenizer()
    text_1 = generate(model, tokenizer, prompt=PROMPT.tolist(), max_tokens=12)
    text_2 = generate(model, tokenizer, prompt=PROMPT.tolist(), max_tokens=12)
    assert text_1 == text_2  # the second call did not see the first one's KV state
    _tokens(model, first, n=5)
    assert first[0].offset == len(PROMPT) + 5  # generate_step runs one step ahead


def test_unpatch_restores_make_cache_and_attention(model):
    had_make_cache = "make_cache" in model.__dict__
    patch_model_kv_cache(model, CONFIG)
    assert mlx_llama.scaled_dot_product_attention is not mlx_base.scaled_dot_product_attention
    patch_model_kv_cache(model, CONFIG)  # re-patching replaces, it does not stack
    assert unpatch_model_kv_cache(model)
    assert mlx_llama.scaled_dot_product_attention is mlx_base.scaled_dot_product_attention
    assert ("make_cache" in model.__dict__) == had_make_cache
    assert all(type(c) is KVCache for c in model.make_cache())
    assert not unpatch_model_kv_cache(model)


def test_other_caches_go_to_the_original_attention(model):
    patch_model_kv_cache(model, CONFIG)
    plain = _tokens(model, [KVCache(), KVCache()])
    unpatch_model_kv_cache(model)
    assert plain == _tokens(model, [KVCache(), KVCache()])


def test_standalone_methods_are_refused_before_make_cache_is_touched(model, monkeypatch):
    monkeypatch.setattr(cache_base, "STANDALONE_METHODS", frozenset({"kivi"}))
    before = model.__dict__.get("make_cache")
    with pytest.raises(QuantizerConfigError, match="standalone"):
        patch_model_kv_cache(model, CONFIG)
    assert model.__dict__.get("make_cache") is before
    assert mlx_llama.scaled_dot_product_attention is mlx_base.scaled_dot_product_attention


def test_a_model_without_attention_layers_is_refused():
    class NotAModel:
        layers = [object(), object()]

    with pytest.raises(QuantizerConfigError, match="NotAModel.*self_attn"):
        KVCacheBuilder.for_model(NotAModel(), CONFIG)
    with pytest.raises(QuantizerConfigError, match="object has no layer list"):
        KVCacheBuilder.for_model(object(), CONFIG)


def test_a_bad_config_fails_at_patch_time(model):
    with pytest.raises(QuantizerConfigError, match="kivi_group_size=64"):
        patch_model_kv_cache(model, KVCacheConfig(method="kivi", kivi_group_size=64))  # head_dim 32
    with pytest.raises(QuantizerConfigError, match="3 entries"):
        patch_model_kv_cache(model, KVCacheConfig(method="kivi", bit_width_inlier=[2, 2, 2]))
    assert "make_cache" not in model.__dict__


def test_save_and_load_prompt_cache_give_the_same_next_tokens(model, tmp_path):
    cache = patch_model_kv_cache(model, CONFIG)
    for _ in generate_step(PROMPT, model, max_tokens=1, prompt_cache=cache, prefill_step_size=128):
        pass
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, cache)
    loaded = load_prompt_cache(path)
    assert [type(c) for c in loaded] == [KIVICache, KIVICache]
    assert loaded[0].offset == cache[0].offset and loaded[0].nbytes == cache[0].nbytes
    follow = mx.array([5, 9, 13])
    assert _tokens(model, loaded, prompt=follow, n=10) == _tokens(model, cache, prompt=follow, n=10)


def test_trim_prompt_cache_then_continue(model):
    cache = patch_model_kv_cache(model, CONFIG)
    model(PROMPT[None], cache=cache)
    # What the trimmed cache should hold: its own decoded history, cut at 200 tokens.
    reference = []
    for c in cache:
        keys, values = c._full_keys_values()
        kv = KVCache()
        kv.update_and_fetch(keys[:, :, :200], values[:, :, :200])
        reference.append(kv)
    assert trim_prompt_cache(cache, 100) == 100
    # Cut inside the compressed part: the re-opened group is decoded into the window, not lost.
    assert cache[0].offset == 200 and cache[0].n_compressed == 192
    step = mx.array([[11]])
    assert mx.allclose(model(step, cache=cache), model(step, cache=reference), atol=1e-3).item()


def test_generate_step_kv_bits_converts_without_losing_history(model):
    cache = patch_model_kv_cache(model, CONFIG)
    tokens = _tokens(model, cache, n=8, kv_bits=4, kv_group_size=32, quantized_kv_start=0)
    assert len(tokens) == 8
    assert all(type(c) is QuantizedKVCache for c in cache)
    assert cache[0].offset == len(PROMPT) + 8  # one step ahead
    # The conversion itself: the whole history, decoded then re-quantized at 4 bits.
    kivi = patch_model_kv_cache(model, CONFIG)
    model(PROMPT[None], cache=kivi)
    keys, values = kivi[0]._full_keys_values()
    converted = kivi[0].to_quantized(group_size=32, bits=4)
    assert converted.offset == kivi[0].offset == len(PROMPT)
    back = mx.dequantize(*converted.keys, group_size=32, bits=4)[:, :, : len(PROMPT)]
    assert back.shape == keys.shape
    assert mx.abs(back - keys).max().item() <= 0.2 * mx.abs(keys).max().item()


def test_vlm_wrapper_gets_caches_for_its_language_model(model):
    import mlx.nn as nn

    class Wrapper(nn.Module):
        def __init__(self, language_model):
            super().__init__()
            self.language_model = language_model

    wrapper = Wrapper(model)
    assert len(KVCacheBuilder.for_model(wrapper, CONFIG)) == 2  # the builder walks language_model too
    first = patch_vlm_kv_cache(wrapper, CONFIG)
    assert [type(c) for c in first] == [KIVICache, KIVICache]
    assert wrapper.make_cache()[0] is not model.make_cache()[0]
    assert type(model.make_cache()[1]) is KIVICache
    assert unpatch_model_kv_cache(wrapper)
    assert "make_cache" not in wrapper.__dict__ and "make_cache" not in model.__dict__
    assert mlx_llama.scaled_dot_product_attention is mlx_base.scaled_dot_product_attention
    with pytest.raises(QuantizerConfigError, match="language_model"):
        patch_vlm_kv_cache(model, CONFIG)


def test_builder_reads_head_dim_from_k_proj_when_the_model_does_not_keep_it():
    from mlx_lm.models import qwen2

    args = qwen2.ModelArgs(model_type="qwen2", hidden_size=128, num_hidden_layers=2, intermediate_size=64,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=32)
    qwen = qwen2.Model(args)
    caches = KVCacheBuilder.for_model(qwen, CONFIG)
    assert [type(c) for c in caches] == [KIVICache, KIVICache]
    first = patch_model_kv_cache(qwen, CONFIG)
    try:
        tokens = _tokens(qwen, first, prompt=mx.array(list(range(30)) * 3), n=4)
        assert len(tokens) == 4 and first[0].head_dim == 32 and first[0].n_kv_heads == 2
    finally:
        unpatch_model_kv_cache(qwen)
