"""bench/ablations.py's `<method>-inplace` specs: the method's caches with the decode window
written in place (cache/window_buffer.py) while base.DECODE_WINDOW_IN_PLACE stays off, so one
interleaved run times both forms."""

import mlx.core as mx
import pytest

from veloxquant_mlx.bench.ablations import WINDOW_METHODS, in_place_windows
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
        in_place_windows([KVCache()])


def test_the_previous_target_warps_spec_marks_its_caches_and_their_launches_take_it(monkeypatch):
    # `kivi-tw4096` / `xquant-tw4096`: the method's caches whose decode launches split the
    # history for 4096 target warps (fused_decode.AFFINE_TARGET_WARPS before session 22) while
    # the module's target stays as shipped; here the module's is set to 1 (one block per head)
    # so that a short history tells the two splits apart (4096 warps: blocks of 512 tokens).
    from tests.cache import cuda_emulation
    from tests.cache.test_fused_decode_emulated import _filled
    from veloxquant_mlx.bench.ablations import ABLATIONS
    from veloxquant_mlx.cache import fused_decode

    assert {"kivi-tw4096", "xquant-tw4096"} <= set(ABLATIONS)
    monkeypatch.setattr(fused_decode, "AFFINE_TARGET_WARPS", 1)
    blocks = {}
    launch = fused_decode.PartialsKernel.attend
    monkeypatch.setattr(fused_decode.PartialsKernel, "attend",
                        lambda self, *a, **k: blocks.setdefault(name, k["n_blocks"]) and launch(self, *a, **k))
    for name in ("kivi", "kivi-tw4096", "xquant-tw4096"):
        cache = parse_layer_spec(f"{name}:{name.split('-')[0]}_residual_length=32").make(0, 2)
        assert cache.decode_target_warps == (4096 if "tw" in name else None)
        q = _filled(cache, 1100, B=1, H=2, rep=4, D=128, dtype=mx.bfloat16)
        with cuda_emulation.signatures_only(), cuda_emulation.emulated_kernels():
            cache.attention(q, scale=128**-0.5)
    # 1088 history tokens (kivi: 1 exact sink token skipped): one block per head and the exact
    # block with the module's target, 3 history blocks of 512 and the exact one with 4096
    assert blocks == {"kivi": 2, "kivi-tw4096": 4, "xquant-tw4096": 4}
