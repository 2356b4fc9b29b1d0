"""for_model + mlx_lm.generate on a tiny random-weight model of each architecture, with every
servable method (tests/architectures/servable.py)."""

import contextlib
import re

import mlx.core as mx
import pytest
from mlx_lm.generate import generate, generate_step
from mlx_lm.models.cache import KVCache, make_prompt_cache

from veloxquant_mlx import (
    KVCacheBuilder,
    QuantizerConfigError,
    patch_model_kv_cache,
    unpatch_model_kv_cache,
)
from veloxquant_mlx.cache.base import CompressedKVCache
from veloxquant_mlx.integration import dispatch
from tests.architectures.servable import config_for, decoded_path_matches, servable_methods
from tests.architectures.tiny_models import ARCHITECTURES, VOCAB, build
from tests.integration.tiny_llama import CharTokenizer

# 300 tokens: past the largest block + exact window of the methods (GEAR encodes 256-token blocks).
PROMPT = mx.array([(i * 7 + 3) % VOCAB for i in range(300)])
N_NEW = 24

# What the rule gives, per architecture: the cache class name of each entry, "ours" for ours.
EXPECTED_PLAN = {
    "llama": ["ours", "ours"],
    "mistral": ["ours", "ours"],
    "qwen2": ["ours", "ours"],
    "qwen3": ["ours", "ours"],
    "phi3": ["ours", "ours"],
    "gemma3_text": ["RotatingKVCache", "ours", "RotatingKVCache", "ours"],
    "gemma2": ["ours", "ours"],
    "mixtral": ["ours", "ours"],
    "nemotron_h": ["ArraysCache", "ours", "ArraysCache", "ours"],
}
# The layer (in model.layers) behind each of our entries.
ATTENTION_LAYERS = {"gemma3_text": [1, 3], "nemotron_h": [1, 4]}


def _tokens(model, cache=None, n=N_NEW):
    out = []
    for token, logprobs in generate_step(PROMPT, model, max_tokens=n, prompt_cache=cache,
                                         prefill_step_size=64):
        assert bool(mx.all(mx.isfinite(logprobs)).item()), "non-finite logprobs"
        out.append(int(token))
    return out


def _builder_or_refusal(model, name, config):
    """The builder, or None after checking that a refusal names the layer."""
    try:
        return KVCacheBuilder(model, config)
    except QuantizerConfigError as exc:
        message = str(exc)
        assert type(model).__name__ in message and re.search(r"layer \d+", message), message
        assert "head_dim" in message, message
        return None


@pytest.mark.parametrize("method", servable_methods())
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_for_model_and_generate(name, method):
    model = build(name)
    config = config_for(method)
    builder = _builder_or_refusal(model, name, config)
    if builder is None:
        return
    caches = builder.build()
    kinds = ["ours" if isinstance(c, CompressedKVCache) else type(c).__name__ for c in caches]
    assert kinds == EXPECTED_PLAN[name]
    assert [a.index for a in builder.attention] == ATTENTION_LAYERS.get(name, list(range(len(caches))))

    # Unpatched model over the K/V our caches decode: the reference path. PyramidKV selects what
    # to keep from the prompt's queries, which only the dispatcher's attention shows it: unpatched
    # it keeps everything and says so.
    unpatched = (pytest.warns(UserWarning, match="no attention call saw the prompt's queries")
                 if method == "pyramidkv" else contextlib.nullcontext())
    with unpatched:
        dequantized = _tokens(model, caches)
    assert len(dequantized) == N_NEW
    ours = [c for c in caches if isinstance(c, CompressedKVCache)]
    assert all(c.offset == len(PROMPT) + N_NEW for c in ours)  # one step ahead
    assert any(c.n_compressed > 0 for c in ours), "the prompt never reached the compressed history"
    # Caches built per layer read their shape from the layer (gemma3's global layers, phi3's 96).
    for cache, layer in zip(ours, builder.attention):
        assert (cache.n_kv_heads, cache.head_dim) == (layer.n_kv_heads, layer.head_dim)

    try:
        patch_model_kv_cache(model, config)
        patched = _tokens(model)  # mlx-lm calls model.make_cache() itself
        text = generate(model, CharTokenizer(VOCAB), prompt=PROMPT.tolist(), max_tokens=8)
    finally:
        unpatch_model_kv_cache(model)
    assert len(patched) == N_NEW and len(text) == 8
    # The patched attention over the compressed form and the decoded path agree (greedy).
    if decoded_path_matches(method):
        assert patched == dequantized
    assert not any(isinstance(c, CompressedKVCache) for c in make_prompt_cache(model))


@pytest.mark.parametrize("method", servable_methods())
def test_llama_cache_is_really_in_the_loop(method):
    """With our caches patched in, the tiny llama generates something else than fp16."""
    model = build("llama")
    fp16 = _tokens(model, [KVCache() for _ in model.layers])
    patch_model_kv_cache(model, config_for(method))
    try:
        ours = _tokens(model)
    finally:
        unpatch_model_kv_cache(model)
    assert ours != fp16, "the cache changed nothing"


def test_phi3_head_dim_96_kivi_groups():
    model = build("phi3")
    builder = KVCacheBuilder(model, config_for("kivi"))
    assert [a.head_dim for a in builder.attention] == [96, 96]  # 3 KIVI groups of 32


def test_head_dim_the_method_refuses_names_the_layer():
    # KIVI group 64 cannot split phi3's head_dim 96: refused at plan time, naming layer 0.
    from veloxquant_mlx import KVCacheConfig

    with pytest.raises(QuantizerConfigError, match=r"mlx_lm.models.phi3.Model layer 0 \(Attention, head_dim=96"):
        KVCacheBuilder(build("phi3"), KVCacheConfig(method="kivi", kivi_group_size=64))


def test_dispatcher_installs_where_the_model_calls_sdpa_and_warns_for_gemma2():
    model = build("nemotron_h")
    try:
        patch_model_kv_cache(model, config_for("kivi"))
        assert "mlx_lm.models.nemotron_h" in dispatch.installed_modules()
    finally:
        unpatch_model_kv_cache(model)
    gemma2 = build("gemma2")
    with pytest.warns(UserWarning, match="gemma2 has no scaled_dot_product_attention"):
        patch_model_kv_cache(gemma2, config_for("kivi"))
    unpatch_model_kv_cache(gemma2)
