"""fused_decode.COMPILED_LAUNCH / a cache's `compiled_launch` (the `<method>-compiled`
ablations): the fused decode launch traced once by mx.compile and replayed, the window's filled
rows as data. Checked on the CPU: the replay itself (a traceable stand-in kernel and the step
census's recorder), and the counted build's attention through the CUDA emulation, equal to the
shipped build's for every window method."""

import contextlib

import mlx.core as mx
import pytest

from tests.cache import cuda_emulation
from tests.cache.cuda_marks import cuda_test
from tests.cache.model_decode import assert_same_attention, decode_outputs
from veloxquant_mlx.bench import step_census
from veloxquant_mlx.bench.ablations import WINDOW_METHODS
from veloxquant_mlx.bench.layer_specs import parse_layer_spec
from veloxquant_mlx.cache import compiled_launch, fused_decode
from veloxquant_mlx.cache.compiled_launch import CompiledLaunch, window_count
from veloxquant_mlx.cache.kernel_name import base_name
from veloxquant_mlx.errors import QuantizerConfigError


def test_the_window_count_is_one_int32_made_once_per_length():
    count = window_count(37)
    assert count.dtype == mx.int32 and count.shape == (1,) and count.item() == 37
    assert window_count(37) is count


def _scaling_kernel(calls: list):
    """A stand-in with a kernel's call signature that MLX can trace: out = x * n[0] + T's
    constant N, shaped as asked."""
    def kernel(*, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        calls.append(dict(template))
        x, n = inputs
        return [(x * n[0] + dict(template)["N"]).astype(output_dtypes[0]).reshape(output_shapes[0])]
    return kernel


def test_a_launch_is_traced_once_and_replayed_with_each_calls_arrays():
    calls, launch = [], CompiledLaunch()
    kernel = _scaling_kernel(calls)
    shape = dict(template=[("N", 1)], grid=(128, 8, 1), threadgroup=(128, 1, 1), output_shape=(1, 4),
                 output_dtype=mx.float32)
    x = mx.array([[1.0, 2.0, 3.0, 4.0]])
    for n in (2, 3, 5):
        out = launch(kernel, [x, window_count(n)], **shape)
        assert out.tolist() == [[n * v + 1 for v in (1.0, 2.0, 3.0, 4.0)]]
    assert launch.traces == len(calls) == 1  # the Python call ran at the trace only
    # Another constant: another function, traced anew; other input shapes: MLX's own new trace.
    assert launch(kernel, [x, window_count(2)], **{**shape, "template": [("N", 10)]}).tolist() == [[12.0, 14.0, 16.0, 18.0]]
    assert launch.traces == 2
    launch(kernel, [mx.ones((2, 2)), window_count(2)], **{**shape, "template": [("N", 10)]})
    assert launch.traces == 3


def _steps(method: str, *, compiled: bool, steps: int, around=contextlib.nullcontext):
    """model_decode.decode_outputs with the window written in place and each cache's
    compiled_launch set -> (outputs, caches)."""
    return decode_outputs(method, {"decode_window_in_place": True, "compiled_launch": compiled}, steps=steps,
                          around=around)


def test_a_compiled_cache_launches_through_the_recorder_at_its_traces_only(monkeypatch):
    # The step census's stand-in launches are lazy nodes MLX can trace: 40 kivi steps (one flush
    # of its 32-token blocks) call the stand-in once per layer and step without compile, and
    # only at the traces with it, each cache's CompiledLaunch counting the same; the census
    # still records one launch per layer and step either way (each compiled call, its node the
    # step's own).
    calls = []
    record = step_census.KernelRecorder.record
    monkeypatch.setattr(step_census.KernelRecorder, "record",
                        lambda self, label, *a: calls.append(label) or record(self, label, *a))

    def decode_launches(compiled):
        recorder = step_census.KernelRecorder()
        calls.clear()
        _, caches = _steps("kivi", compiled=compiled, steps=40, around=lambda: step_census.cuda_path(recorder))
        recorded = [label for label, _ in recorder.launches if "_decode_partials" in label]
        return [c for c in calls if "_decode_partials" in c], recorded, caches

    called, recorded, _ = decode_launches(False)
    assert len(called) == len(recorded) == 4 * 40 and not any(label.endswith("_counted") for label in called)
    called, recorded, caches = decode_launches(True)
    assert len(recorded) == 4 * 40 and all(label.endswith("_merged_counted") for label in recorded)
    traces = sum(c._fused_launch.compiled.traces for c in caches)
    # One trace per layer: the flush's new launch plan kept the template, grid and shapes.
    assert len(called) == traces == 4


@pytest.fixture
def eager_compile(monkeypatch):
    """The CPU emulation runs kernels eagerly (numpy): the launch is called, not traced."""
    monkeypatch.setattr(compiled_launch, "compile_function", lambda function: function)


# Each method's emulated programs take ~30 s to build on 2 cores: kivi's in the CI subset.
EMULATED_METHODS = [m if m == "kivi" else pytest.param(m, marks=pytest.mark.slow) for m in WINDOW_METHODS]


@pytest.mark.parametrize("method", EMULATED_METHODS)
def test_the_counted_build_gives_the_shipped_builds_attention(method, eager_compile):
    # Emulated on the CPU: the counted build (wn[0] as the window's rows) against the shipped
    # one (wn's length), window in place both ways, two decode steps of every layer.
    made = []

    @contextlib.contextmanager
    def emulated():  # the decode steps only: the prefill takes the portable path both times
        with cuda_emulation.emulated_kernels() as kernels:
            yield
        made.extend(kernels)

    plain, _ = _steps(method, compiled=False, steps=2, around=emulated)
    made.clear()
    counted, caches = _steps(method, compiled=True, steps=2, around=emulated)
    assert any(base_name(k.name).endswith("_merged_counted") for k in made)
    # Eager, every launch is a call. The second step's are all compiled (minicache: its two
    # paired layers launch); the first step's only where the window was already the in-place
    # buffers (not gear's, whose prefill's last flush emptied it, nor minicache's pairs').
    compiled = sum(c._fused_launch.compiled.traces for c in caches if "_fused_launch" in c.__dict__)
    assert (2 if method == "minicache" else 4) <= compiled <= (4 if method == "minicache" else 8)
    assert_same_attention(plain, counted)


def test_a_compiled_launch_writes_the_window_in_place_where_the_kernels_run(monkeypatch):
    cache = parse_layer_spec("kivi").make(0, 1)
    assert fused_decode.wants_compiled_launch(cache)  # as shipped
    # Off the kernels (this CPU) the window grows by concatenation as before.
    assert not fused_decode.writes_window_in_place(cache)
    monkeypatch.setattr(fused_decode, "kernels_enabled", lambda: True)
    assert fused_decode.writes_window_in_place(cache)
    assert fused_decode.compiles_launches(cache, buffered=True)
    # A step whose window is not in place yet (the first token after a flush emptied it).
    assert not fused_decode.compiles_launches(cache, buffered=False)
    cache.compiled_launch = False
    assert not fused_decode.writes_window_in_place(cache)
    assert not fused_decode.compiles_launches(cache, buffered=True)


def test_a_decode_step_on_the_kernels_writes_the_window_in_place(monkeypatch):
    cache = parse_layer_spec("kivi").make(0, 1)
    monkeypatch.setattr(fused_decode, "kernels_enabled", lambda: True)
    token = mx.zeros((1, 2, 1, 64), mx.float16)
    cache.update_and_fetch(mx.zeros((1, 2, 3, 64), mx.float16), mx.zeros((1, 2, 3, 64), mx.float16))
    cache.update_and_fetch(token, token)
    held = cache.window_buffers()
    assert held is not None and held[2] == 4
    uncompiled = parse_layer_spec("kivi-uncompiled").make(0, 1)
    uncompiled.update_and_fetch(mx.zeros((1, 2, 3, 64), mx.float16), mx.zeros((1, 2, 3, 64), mx.float16))
    uncompiled.update_and_fetch(token, token)
    assert uncompiled.window_buffers() is None and uncompiled.window_keys.shape[2] == 4


def test_a_compiled_launch_refuses_baked_constants_and_the_split_launch(monkeypatch):
    kernel = fused_decode.PartialsKernel("vq_test_partials", ["q"], "", "")
    call = dict(inputs=[], template=[], n_blocks=1, heads=1, value_dim=8, compiled=True)
    with pytest.raises(QuantizerConfigError, match="set one of the two"):
        kernel.attend(mx.zeros((1, 4, 1, 8)), baked=True, **call)
    monkeypatch.setattr(fused_decode, "MERGE_IN_KERNEL", False)
    with pytest.raises(QuantizerConfigError, match="fused launch only; MERGE_IN_KERNEL is off"):
        kernel.attend(mx.zeros((1, 4, 1, 8)), **call)


def test_the_ablation_sets_the_switch_and_the_window_it_needs():
    cache = parse_layer_spec("gear-compiled").make(0, 1)
    assert cache.compiled_launch is True and cache.decode_window_in_place is True
    assert fused_decode.COMPILED_LAUNCH is True  # compiled as shipped since session 36
    assert parse_layer_spec("gear-uncompiled").make(0, 1).compiled_launch is False


@cuda_test
@pytest.mark.parametrize("method", WINDOW_METHODS)
def test_a_compiled_launch_gives_the_shipped_launchs_attention_on_the_gpu(method):
    # NVRTC compiles the counted build, mx.compile traces and replays it: 40 steps (a flush of
    # every method's blocks but gear's 256) the shipped launch's attention (assert_same_attention).
    plain, _ = _steps(method, compiled=False, steps=40)
    compiled, caches = _steps(method, compiled=True, steps=40)
    assert sum(c._fused_launch.compiled.traces for c in caches if "_fused_launch" in c.__dict__) < 40
    assert_same_attention(plain, compiled)
