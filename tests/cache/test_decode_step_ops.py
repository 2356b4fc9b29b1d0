"""The decode-step paths of xquant, minicache and kvquant after their ops were trimmed
(bench/step_census.py counts them): outputs and state bit-identical to the former code, which
is kept here as reference subclasses, and the ops a step builds fewer."""

import mlx.core as mx
import pytest

from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.bench.step_census import (
    KernelRecorder,
    cuda_path,
    graph_counts,
    primitive_id,
    state_arrays,
)
from veloxquant_mlx.cache import fused_decode
from veloxquant_mlx.cache.xquant import XQuantCache

B, H, D, REP = 1, 2, 64, 2


def kv(n, seed, dtype=mx.float16):
    """Evaluated (as a step's inputs are when its graph is counted)."""
    k = mx.random.normal((B, H, n, D), key=mx.random.key(seed)).astype(dtype)
    v = mx.random.normal((B, H, n, D), key=mx.random.key(seed + 1000)).astype(dtype)
    mx.eval(k, v)
    return k, v


def query(n, seed):
    q = mx.random.normal((B, H * REP, n, D), key=mx.random.key(seed)).astype(mx.float16)
    mx.eval(q)
    return q


class SplitFlushXQuant(XQuantCache):
    """XQuantCache with the follower flush as it was: cut the window at ready + residual,
    flush the head, concatenate the tail back."""

    def _flush(self) -> None:
        if self.n_compressed == 0 and self.capacity == 0 and self.window_keys is not None:
            self.shared = self._leader() is not None
        if not self.shared or self.window_keys is None:
            return super(XQuantCache, self)._flush()
        leader = self._leader()
        ready = 0 if leader is None else max(0, leader.n_compressed - self.n_compressed)
        keep = ready + self.residual_length
        if self.window_keys.shape[2] <= keep:
            return super(XQuantCache, self)._flush()
        tail_k, tail_v = self.window_keys[:, :, keep:], self.window_values[:, :, keep:]
        self.window_keys, self.window_values = self.window_keys[:, :, :keep], self.window_values[:, :, :keep]
        if keep == 0:
            self.window_keys = self.window_values = None
        else:
            super(XQuantCache, self)._flush()
        if self.window_keys is None:
            self.window_keys, self.window_values = tail_k, tail_v
        else:
            self.window_keys = mx.concatenate([self.window_keys, tail_k], axis=2)
            self.window_values = mx.concatenate([self.window_values, tail_v], axis=2)


def run_steps(caches, schedule, order=None):
    """Feeds each entry (tokens) of the schedule to every layer, attention after each update;
    the prompt (first entry) in layer order, the rest in `order` (default: layer order).
    Returns every output and the final state arrays, evaluated."""
    outs = []
    for seed, n in enumerate(schedule):
        for i in (order if order and seed else range(len(caches))):
            cache = caches[i]
            cache.update_and_fetch(*kv(n, 100 * seed + i))
            out = cache.attention(query(n, 100 * seed + i + 50), scale=D**-0.5, mask="causal" if n > 1 else None)
            mx.eval(out, *state_arrays(cache))
            outs.append(out)
    return outs, [state_arrays(c) for c in caches]


def assert_identical(a, b):
    outs_a, states_a = a
    outs_b, states_b = b
    assert len(outs_a) == len(outs_b)
    for x, y in zip(outs_a, outs_b):
        assert x.shape == y.shape and mx.array_equal(x, y).item()
    for sa, sb in zip(states_a, states_b):
        assert len(sa) == len(sb)
        for x, y in zip(sa, sb):
            assert x.shape == y.shape and mx.array_equal(x, y).item()


# Prompt, then decode steps across block flushes (group 32); a longer chunk in the middle.
SCHEDULE = [70, *[1] * 24, 33, *[1] * 8]


@pytest.mark.parametrize("residual", [0, 8])
# Leader first (as in a model), or the follower first after the prompt: its flushes then see
# a leader one step behind (the bounded flush).
@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_xquant_follower_flush_is_bit_identical(residual, order):
    config = KVCacheConfig(method="xquant", xquant_residual_length=residual)
    ours = run_steps(XQuantCache.build_layers(config, 2), SCHEDULE, order)
    ref = run_steps(SplitFlushXQuant.build_layers(config, 2), SCHEDULE, order)
    assert_identical(ours, ref)
    assert ours[1][1] and len(ours[1][1]) < len(ours[1][0])  # the follower shares codes


def test_xquant_follower_step_builds_no_split_window():
    """A follower's decode step without a flush: the window's append (2 concatenations) and
    the attention, as its leader's; the split and re-concatenation are gone."""
    config = KVCacheConfig(method="xquant", xquant_residual_length=8)

    def follower_step(cls):
        caches = cls.build_layers(config, 2)
        run_steps(caches, [64, 1])
        counts = []
        for i, cache in enumerate(caches):
            cache.update_and_fetch(*kv(1, 7 + i))
            q = query(1, 9)
            counts.append(graph_counts([cache.attention(q, scale=D**-0.5), *state_arrays(cache)], {}))
        return counts

    leader, follower = follower_step(XQuantCache)
    _, old_follower = follower_step(SplitFlushXQuant)
    # The base flushes twice a step (update, after attention); each old split was 4 slices
    # and 2 concatenations.
    assert follower == leader
    assert old_follower["Concatenate"] == follower["Concatenate"] + 4
    assert old_follower["Slice"] == follower.get("Slice", 0) + 8


def cuda_step_counts(caches, steps=2):
    """Primitives of each layer's decode step (the last of `steps`; the first ones build
    one-time constants such as the kernels' absent inputs) on step_census's CUDA path."""
    recorder = KernelRecorder()
    with cuda_path(recorder):
        for step in range(steps):
            counts = []
            for i, cache in enumerate(caches):
                cache.update_and_fetch(*kv(1, 7 + i + 10 * step))
                out = cache.attention(query(1, 9), scale=D**-0.5)
                launched = {primitive_id(node): label for label, node in recorder.launches}
                counts.append(graph_counts([out, *state_arrays(cache)], launched))
                mx.eval(out, *state_arrays(cache))
                recorder.launches.clear()
    return counts


def test_census_recorder_runs_the_cuda_path_of_xquant():
    """On the CUDA path as shipped (fused_decode.COMPILED_LAUNCH) a step of the leader and of
    the follower is one kernel, the counted build with the merge fused in, and the window's
    token written in place: two slice writes into its buffers and the two views of their filled
    rows (slices: views, no launch); the window's count is data made once per length
    (compiled_launch.window_count), no node of the step. The key codes' reshape is the launch
    plan's, made once per flush."""
    config = KVCacheConfig(method="xquant", xquant_residual_length=8)
    caches = XQuantCache.build_layers(config, 2)
    run_steps(caches, [64, 1])
    leader, follower = cuda_step_counts(caches)
    shipped = {"SliceUpdate": 2, "Slice": 2, "CustomKernel:vq_affine_decode_partials_merged_counted": 1}
    assert leader == shipped, leader
    assert follower == shipped, follower


def test_census_recorder_runs_the_uncompiled_cuda_path_of_xquant(monkeypatch):
    """Uncompiled (the `-uncompiled` ablations), the follower's step is the leader's: one kernel
    (the merge fused in) and two concatenations (the window's append). The leader's step is the
    process's first at its window length (the views forgotten first): its graph also holds the
    kernel's window-rows view (fused_decode.window_rows; a slice: a view, no launch), evaluated
    with the step rather than by an mx.eval of its own (session 24: a host sync); the
    follower's step, at the same length, reuses it."""
    monkeypatch.setattr(fused_decode, "COMPILED_LAUNCH", False)
    config = KVCacheConfig(method="xquant", xquant_residual_length=8)
    caches = XQuantCache.build_layers(config, 2)
    run_steps(caches, [64, 1])
    fused_decode.window_rows.cache_clear()
    leader, follower = cuda_step_counts(caches)
    assert leader == {"Concatenate": 2, "Slice": 1, "CustomKernel:vq_affine_decode_partials_merged": 1}, leader
    assert follower == {"Concatenate": 2, "CustomKernel:vq_affine_decode_partials_merged": 1}, follower


@pytest.mark.parametrize("method", ["xquant", "kvquant", "minicache"])
def test_census_takes_the_kernel_path_the_emulation_runs(method):
    """The kernels step_census records for a decode step are the ones the CUDA emulation
    (tests/cache/cuda_emulation.py) builds and runs for the same step, and the emulated step's
    output matches the portable step's."""
    from tests.cache.cuda_emulation import COMPILER, emulated_decode_step

    if COMPILER is None:
        pytest.skip("no g++ with C++20 for the emulation")
    from veloxquant_mlx.cache.registry import cache_class

    cls, config = cache_class(method), KVCacheConfig(method=method)
    # minicache pairs from half the depth on: layers 2 and 3 of 4 (the last is the upper one).
    caches = [cls(config, 0, 1)] if method == "kvquant" else cls.build_layers(config, 4 if method == "minicache" else 2)
    run_steps(caches, [200, 1])
    cache = caches[-1]
    cache.update_and_fetch(*kv(1, 77))
    q = query(1, 78)
    recorder = KernelRecorder()
    with cuda_path(recorder):
        cache.attention(q, scale=D**-0.5)
    # attention flushes after the step; the decode step proper is what was recorded before it.
    recorded = [label.split(":", 1)[1] for label, _ in recorder.launches if label.startswith("CustomKernel:")]
    out, made = emulated_decode_step(cache, q, D**-0.5)
    assert recorded and sorted(recorded) == sorted(k.name for k in made if k.calls)
    portable = cache.attention(q, scale=D**-0.5)
    assert mx.allclose(out, portable, atol=2e-2, rtol=2e-2).item()
