"""base.DECODE_WINDOW_IN_PLACE (cache/window_buffer.py): decode steps write their token into the
window's buffers in place; the history, the attention and the state stay what the
concatenation gives, across flushes, trims and state loads. The decode kernels reading the
buffers (wn, fused_decode.window_rows) are checked in test_fused_decode_emulated.py."""

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache import base, fused_decode, window_buffer
from veloxquant_mlx.cache.factory import KVCacheFactory

METHODS = ["kivi", "xquant", "turboquant_rvq", "kvquant", "gear", "minicache", "pyramidkv"]


def _tokens(n, seed, D=64):
    mx.random.seed(seed)
    return (mx.random.normal((1, 2, n, D)).astype(mx.float16), mx.random.normal((1, 2, n, D)).astype(mx.float16))


def _run(method, in_place, monkeypatch, steps=80):
    """A layer's prefill (2 chunks) and `steps` decode steps, each attended: the outputs and the
    cache."""
    monkeypatch.setattr(base, "DECODE_WINDOW_IN_PLACE", int(in_place))
    # layer 3 of 4: a paired layer of minicache (its paired layers go through the base's update)
    cache = KVCacheFactory.create(KVCacheConfig(method=method), 3, 4)
    outs = []
    for i, n in enumerate((96, 64)):
        k, v = _tokens(n, i)
        cache.update_and_fetch(k, v)
        q = mx.random.normal((1, 4, n, 64)).astype(mx.float16)
        outs.append(cache.attention(q, scale=0.125, mask="causal"))
    cache.steps_with_a_window = 0  # decode steps that found a window to append to
    for t in range(steps):
        k, v = _tokens(1, 100 + t)
        cache.steps_with_a_window += getattr(cache, "window_keys", None) is not None
        cache.update_and_fetch(k, v)
        outs.append(cache.attention(mx.random.normal((1, 4, 1, 64)).astype(mx.float16), scale=0.125))
    mx.eval(outs)
    return outs, cache


@pytest.mark.parametrize("method", METHODS)
def test_in_place_decode_steps_give_the_concatenations_attention_and_window(method, monkeypatch):
    mx.random.seed(7)
    want, ref = _run(method, False, monkeypatch)
    mx.random.seed(7)
    calls = []
    append = window_buffer.append_token
    monkeypatch.setattr(window_buffer, "append_token", lambda *a: calls.append(1) or append(*a))
    got, cache = _run(method, True, monkeypatch)
    # every decode step wrote in place, but pyramidkv's, whose update is its own
    assert len(calls) == (0 if method == "pyramidkv" else cache.steps_with_a_window) and len(calls) in (0, *range(60, 81))
    for i, (a, b) in enumerate(zip(got, want)):
        assert mx.array_equal(a, b).item(), (method, i)
    assert cache.offset == ref.offset
    if hasattr(ref, "n_compressed"):
        assert cache.n_compressed == ref.n_compressed
    if ref.window_keys is None:  # pyramidkv keeps no exact window of the base's kind
        assert cache.window_keys is None
    else:
        assert mx.array_equal(cache.window_keys, ref.window_keys).item()
        assert mx.array_equal(cache.window_values, ref.window_values).item()


def test_the_buffers_hold_the_window_with_under_a_block_of_slack(monkeypatch):
    mx.random.seed(3)
    _, ref = _run("kivi", False, monkeypatch, steps=5)
    mx.random.seed(3)
    _, cache = _run("kivi", True, monkeypatch, steps=5)
    buf_k, buf_v, n = cache.window_buffers()
    assert n == cache.window_keys.shape[2] and buf_k.shape[2] == cache.residual_length + cache.block_size
    assert buf_k.shape[2] - n < cache.block_size + cache.residual_length
    assert mx.array_equal(buf_k[:, :, :n], cache.window_keys).item()
    # nbytes counts the buffers whole, as mlx-lm's KVCache counts its own
    slack = buf_k.nbytes + buf_v.nbytes - cache.window_keys.nbytes - cache.window_values.nbytes
    assert slack > 0 and cache.nbytes == ref.nbytes + slack
    # the kernels get the buffers and the filled rows as a view's length
    keys, values, rows = fused_decode.window_inputs(cache, mx.float16, cache.window_buffers())
    assert keys is buf_k and values is buf_v and rows.shape == (n,)


def test_a_window_assigned_elsewhere_makes_the_buffers_stale(monkeypatch):
    _, cache = _run("kivi", True, monkeypatch, steps=5)
    assert cache.window_buffers() is not None
    cache.trim(3)
    assert cache.window_buffers() is None  # the trim's window is not the buffers' view
    keys, values, rows = fused_decode.window_inputs(cache, mx.float16, cache.window_buffers())
    assert keys is cache.window_keys and rows.shape == (cache.window_keys.shape[2],)
    before = cache.window_keys
    k, v = _tokens(1, 999)
    cache.update_and_fetch(k, v)  # rebuilt from the window as it now is
    buf_k, _, n = cache.window_buffers()
    assert n == before.shape[2] + 1
    assert mx.array_equal(buf_k[:, :, : n - 1], before).item() and mx.array_equal(buf_k[:, :, n - 1 : n], k).item()


def test_a_state_round_trip_keeps_the_filled_rows_only(monkeypatch):
    _, cache = _run("gear", True, monkeypatch, steps=7)
    state, meta = cache.state, cache.meta_state
    assert state[1].shape[2] == cache.window_keys.shape[2]
    other = KVCacheFactory.create(KVCacheConfig(method="gear"), 3, 4)
    other.state, other.meta_state = state, meta
    assert other.window_buffers() is None
    assert np.array_equal(np.array(other.window_keys), np.array(cache.window_keys))


def test_a_window_of_no_rows_is_refused():
    with pytest.raises(Exception, match="a window of 0 rows; allowed is at least 1"):
        fused_decode.window_rows(0)


def test_window_rows_views_share_one_zero_array_grown_for_long_windows():
    a, b = fused_decode.window_rows(5), fused_decode.window_rows(5)
    assert a is b and a.shape == (5,) and a.dtype == mx.uint8
    long = fused_decode.window_rows(3000)
    assert long.shape == (3000,) and not mx.any(long).item()


def test_window_rows_waits_on_nothing(monkeypatch):
    # mx.eval waits for every launch queued before it: on the H200 the eval it made for each
    # window length's first step cost GEAR ~1.3 ms per step over its first 255 decode tokens.
    def waits(*arrays):
        raise AssertionError("window_rows evaluated (a host sync on a GPU)")

    monkeypatch.setattr(mx, "eval", waits)
    monkeypatch.setattr(mx, "synchronize", waits)
    fresh = fused_decode.window_rows(4099)  # a length no other test asks for, and a new base
    assert fresh.shape == (4099,) and fused_decode.window_rows(4099) is fresh
    monkeypatch.undo()
    assert not mx.any(fresh).item()
