"""replay_step.ReplayStep: a launch plan's later compiled decode steps swap the step's arrays into
the plan's and replay the traced launch; anything it holds that moved sends the step down the
full path (PartialsKernel.attend), which also refuses what a compiled launch cannot take. The
attention a replay gives is the shipped launch's: test_compiled_launch's emulated comparison
runs its second step through it."""

import contextlib

import mlx.core as mx
import pytest

from tests.cache import cuda_emulation
from tests.cache.model_decode import SHAPE, assert_same_attention, decode_outputs
from veloxquant_mlx.bench import step_census
from veloxquant_mlx.bench.ablations import WINDOW_METHODS
from veloxquant_mlx.bench.tiny import random_llama
from veloxquant_mlx.cache import compiled_launch, fused_decode
from veloxquant_mlx.cache.compiled_launch import window_count
from veloxquant_mlx.cache.replay_step import ReplayStep
from veloxquant_mlx.errors import QuantizerConfigError


def _replay(dtype=mx.float16):
    """A ReplayStep over a plan of 5 inputs (queries 0, window keys / values / rows 2, 3, 4) whose
    traced function returns its arguments."""
    state = fused_decode.FusedLaunchState()
    state.counts, state.scratch = mx.zeros((4,), mx.int32), mx.zeros((64,), mx.float32)
    state.compiled.function = lambda *arrays: list(arrays)
    store = mx.ones((3,))
    kernel = object()
    replay = ReplayStep("plan", kernel, state, [None, store, None, None, None], (2, 3, 4), dtype)
    return replay, kernel, state, store


def _held(n, dtype=mx.float16, other=None):
    keys, values = mx.zeros((1, 2, 8, 4), dtype), mx.zeros((1, 2, 8, 4), other or dtype)
    return (keys, values, keys[:, :, :n], values[:, :, :n], n, 8, keys.dtype, values.dtype)


def test_a_replay_puts_the_steps_arrays_in_the_plans_and_follows_the_last_launch():
    replay, kernel, state, store = _replay()
    queries, held = mx.zeros((1, 4, 1, 4), mx.float16), _held(5)
    out = replay.run(kernel, state, queries, held)
    assert out[0] is queries and out[1] is store and out[2] is held[0] and out[3] is held[1]
    assert out[4] is window_count(5) and out[5] is state.counts and out[6] is state.scratch
    assert out[7] is queries  # nothing launched before: follows an input already there
    assert state.last_out is out
    state.last_out = mx.zeros((1, 4, 1, 4), mx.float16)
    follows = state.last_out
    assert replay.run(kernel, state, queries, _held(6))[7] is follows
    state.last_out = mx.zeros((1, 4, 1, 4), mx.float32)  # another dtype: not followed
    assert replay.run(kernel, state, queries, _held(6))[7] is queries


def test_a_replay_declines_where_what_it_holds_moved():
    replay, kernel, state, _ = _replay()
    queries = mx.zeros((1, 4, 1, 4), mx.float16)
    assert replay.run(object(), state, queries, _held(5)) is None  # another kernel object
    assert replay.run(kernel, fused_decode.FusedLaunchState(), queries, _held(5)) is None
    assert replay.run(kernel, state, queries, None) is None  # the window not in place
    assert replay.run(kernel, state, queries, _held(5, other=mx.float32)) is None  # would need a cast
    state.scratch = mx.zeros((128,), mx.float32)  # grown by another launch
    assert replay.run(kernel, state, queries, _held(5)) is None
    replay, kernel, state, _ = _replay()
    state.compiled.function = lambda *arrays: None  # traced anew
    assert replay.run(kernel, state, queries, _held(5)) is None


def _kivi_steps(steps: int, between=None):
    """kivi's caches of the census's model, `steps` decode steps on CUDA's path with the
    launches recorded -> (caches, recorder, the full path's attend calls); `between(caches)` runs
    after the first step."""
    model = random_llama(hidden=256, layers=4, intermediate=64, vocab=64, dtype=mx.bfloat16,
                         **step_census.LLAMA_8B_ATTENTION)
    attends = []
    attend = fused_decode.PartialsKernel.attend
    recorder = step_census.KernelRecorder()
    with step_census.method_caches("kivi", model) as (caches, attention):
        step_census.prefill(caches, attention, history=1024, chunk=512, seed=0, **SHAPE)
        with step_census.cuda_path(recorder), pytest.MonkeyPatch.context() as patch:
            patch.setattr(fused_decode.PartialsKernel, "attend",
                          lambda self, *a, **k: attends.append(1) or attend(self, *a, **k))
            for s in range(steps):
                if s == 1 and between is not None:
                    between(caches)
                for i, cache in enumerate(caches):
                    k, v, q = (step_census._random(shape, mx.bfloat16, 100 * s + 10 * i + j) for j, shape in enumerate(
                        ((1, 8, 1, 128), (1, 8, 1, 128), (1, 32, 1, 128))))
                    keys, values = cache.update_and_fetch(k, v)
                    mx.eval(attention(q, keys, values, cache=cache, scale=128 ** -0.5, mask=None))
    return caches, recorder, attends


def test_a_plans_later_steps_skip_the_full_path_and_still_launch_each_step():
    # 40 steps of 4 layers, kivi's 32-token blocks: one flush each, so two plans per layer.
    caches, recorder, attends = _kivi_steps(40)
    launched = [label for label, _ in recorder.launches if "_decode_partials" in label]
    assert len(launched) == 4 * 40 and all(label.endswith("_merged_counted") for label in launched)
    assert 4 <= len(attends) <= 4 * 3  # a plan's first step (and a step whose window was not in place)
    assert all(c.__dict__["_fused_replay"].plan is c.__dict__["_fused_plan"] for c in caches)
    # A new plan drops the old one's replay (and the store arrays it holds) at once: here a
    # plan for another caller key, whose launch the kernels do not take (the portable path).
    cache = caches[0]
    queries = mx.zeros((1, 32, 1, 128), mx.bfloat16)
    assert fused_decode.planned_attend(cache, queries, 0.1, "another key", lambda: None, None) is None
    assert "_fused_replay" not in cache.__dict__


def test_a_switch_set_between_steps_is_refused_not_replayed():
    def bake(caches):
        for cache in caches:
            cache.baked_constants = True  # with the compiled launch as shipped: refused by attend

    with pytest.raises(QuantizerConfigError, match="set one of the two"):
        _kivi_steps(3, between=bake)


# Each method's emulated programs take ~30 s to build on 2 cores and four steps run eagerly:
# all slow (~8 min for the six). The CI subset replays kivi's second step in
# test_compiled_launch's counted-build comparison.
EMULATED_METHODS = [pytest.param(m, marks=pytest.mark.slow) for m in WINDOW_METHODS]


@pytest.mark.skipif(cuda_emulation.COMPILER is None,
                    reason="needs g++ with C++20 std::barrier and _Float16 for the kernels' CPU emulation")
@pytest.mark.parametrize("method", EMULATED_METHODS)
def test_replayed_steps_give_the_uncompiled_launchs_attention(method, monkeypatch):
    # Emulated on the CPU (eager: the launch is called, not traced): 4 decode steps of every
    # layer, so that every method's plans see later steps with the window in place (gear's and
    # minicache's first step after the prefill is not), against the plain launch's attention.
    monkeypatch.setattr(compiled_launch, "compile_function", lambda function: function)
    attends = []
    attend = fused_decode.PartialsKernel.attend

    @contextlib.contextmanager
    def emulated():
        with cuda_emulation.emulated_kernels(), pytest.MonkeyPatch.context() as patch:
            patch.setattr(fused_decode.PartialsKernel, "attend",
                          lambda self, *a, **k: attends.append(1) or attend(self, *a, **k))
            yield

    settings = {"decode_window_in_place": True}
    plain, _ = decode_outputs(method, {**settings, "compiled_launch": False}, steps=4, around=emulated)
    full = len(attends)
    attends.clear()
    replayed, caches = decode_outputs(method, {**settings, "compiled_launch": True}, steps=4, around=emulated)
    assert any("_fused_replay" in c.__dict__ for c in caches)
    assert len(attends) < full  # some steps replayed instead of the full path
    assert_same_attention(plain, replayed)
