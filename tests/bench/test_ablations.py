"""bench/ablations.py's `<method>-inplace` specs: the method's caches with the decode window
written in place (cache/window_buffer.py) while base.DECODE_WINDOW_IN_PLACE stays off, so one
interleaved run times both forms."""

import mlx.core as mx
import pytest

from veloxquant_mlx.bench.ablations import WINDOW_METHODS, in_place_window
from veloxquant_mlx.bench.layer_specs import parse_layer_spec
from veloxquant_mlx.bench.tiny import random_llama
from veloxquant_mlx.cache import base, window_buffer


@pytest.fixture(scope="module")
def model():
    # 4 layers: minicache pairs layers 2 and 3 (its first half are plain layers)
    return random_llama(hidden=128, layers=4, heads=2, kv_heads=1, head_dim=64, intermediate=256, vocab=256)


def _greedy(model, spec, steps=40):
    """A 300-token prompt and `steps` greedy tokens through the spec's cache list: the logits
    of every step, and the list."""
    mx.random.seed(5)
    prompt = mx.random.randint(0, 256, (1, 300))
    with spec.open(model) as make_cache:
        cache = make_cache()
        logits = model(prompt, cache=cache)[:, -1]
        out = [logits]
        for _ in range(steps):
            logits = model(mx.argmax(logits, axis=-1)[:, None], cache=cache)[:, -1]
            out.append(logits)
    mx.eval(out)
    return out, cache


@pytest.mark.parametrize("method", WINDOW_METHODS)
def test_inplace_spec_writes_in_place_and_gives_the_plain_specs_logits(method, model, monkeypatch):
    assert base.DECODE_WINDOW_IN_PLACE == 0
    want, _ = _greedy(model, parse_layer_spec(method))
    calls = []
    append = window_buffer.append_token
    monkeypatch.setattr(window_buffer, "append_token", lambda *a: calls.append(1) or append(*a))
    got, cache = _greedy(model, parse_layer_spec(f"{method}-inplace"))
    assert all(getattr(c, "decode_window_in_place", False) for c in cache)
    # every decode step of every layer that had a window to append to wrote in place
    assert len(calls) > 0
    for i, (a, b) in enumerate(zip(got, want)):
        assert mx.array_equal(a, b).item(), (method, i)


def test_inplace_spec_takes_the_methods_fields():
    spec = parse_layer_spec("kivi-inplace:kivi_residual_length=32")
    assert spec.kind == "ablation" and spec.params["kivi_residual_length"] == 32
    assert spec.make(0, 1).decode_window_in_place


def test_a_list_without_our_caches_is_refused():
    from mlx_lm.models.cache import KVCache

    with pytest.raises(TypeError, match="KVCache"):
        in_place_window.mark([KVCache()])


@pytest.mark.parametrize("method", WINDOW_METHODS)
def test_a_target_warps_spec_marks_its_caches_and_their_launches_take_it(method, monkeypatch):
    # `<method>-tw4096`: the method's caches whose decode launches split the history for 4096
    # target warps whatever the kernel's own target; here every kernel's own is set to 1 (one
    # block per head: the most tiles per warp), so a short history tells the two splits apart.
    from tests.cache import cuda_emulation
    from tests.cache.test_fused_decode_emulated import _filled
    from veloxquant_mlx.cache import fused_decode, fused_decode_merged, fused_decode_rotated

    for module, name in ((fused_decode, "TARGET_WARPS"), (fused_decode, "AFFINE_TARGET_WARPS"),
                         (fused_decode_rotated, "TARGET_WARPS"), (fused_decode_merged, "TARGET_WARPS")):
        monkeypatch.setattr(module, name, 1)
    blocks = {}
    launch = fused_decode.PartialsKernel.attend
    monkeypatch.setattr(fused_decode.PartialsKernel, "attend",
                        lambda self, *a, **k: blocks.setdefault(spec_name, k["n_blocks"]) and launch(self, *a, **k))
    for spec_name in (method, f"{method}-tw4096"):
        # minicache: layer 1 of 2 is the pair's upper layer from its first token on
        fields = "minicache_start_fraction=0" if method == "minicache" else ""
        spec = parse_layer_spec(f"{spec_name}:{fields}" if fields else spec_name)
        with spec.open(_pair_model()) as make_cache:
            caches = make_cache()
            assert all(c.decode_target_warps == (4096 if "tw" in spec_name else None) for c in caches)
            # filled on the portable path; the decode step's launch recorded, not run
            queries = [_filled(cache, 1500, B=1, H=2, rep=4, D=128, dtype=mx.bfloat16) for cache in caches]
            with cuda_emulation.signatures_only(), cuda_emulation.emulated_kernels():
                for cache, q in zip(caches, queries):
                    cache.attention(q, scale=128**-0.5)
    assert blocks[method] < blocks[f"{method}-tw4096"], blocks


def _pair_model():
    """A 2-layer llama of the 8B attention shape (GQA 4, head_dim 128) for the specs' lists."""
    return random_llama(hidden=256, layers=2, heads=8, kv_heads=2, head_dim=128, intermediate=256, vocab=64)


def test_kvplain_spec_holds_minicaches_plain_layers_in_mlx_lm_kv_caches_with_the_same_logits(model):
    from mlx_lm.models.cache import KVCache

    from veloxquant_mlx.cache.minicache import MiniCacheCache

    want, shipped = _greedy(model, parse_layer_spec("minicache"))
    got, cache = _greedy(model, parse_layer_spec("minicache-kvplain"))
    assert [c.role for c in shipped] == ["plain", "plain", "lower", "upper"]
    assert [type(c) for c in cache] == [KVCache, KVCache, MiniCacheCache, MiniCacheCache]
    assert cache[2].n_compressed > 0  # the pair still merges
    for i, (a, b) in enumerate(zip(got, want)):
        assert mx.array_equal(a, b).item(), i


def test_kvplain_refuses_a_list_without_minicache():
    from veloxquant_mlx.bench.ablations import plain_layers_as_kv_cache

    with pytest.raises(TypeError, match="MiniCacheCache"):
        plain_layers_as_kv_cache.mark([parse_layer_spec("kivi").make(0, 1)])
