"""bench.step_census: the graph counts, the CUDA-path stand-ins, and the command end to end."""

import json
import subprocess
import sys

import mlx.core as mx
import pytest

from veloxquant_mlx.bench import step_census
from veloxquant_mlx.bench.step_census import (
    KernelRecorder,
    cuda_path,
    graph_counts,
    launches_of,
    primitive_id,
)
from veloxquant_mlx.cache import fused_decode


def evaluated(*shape):
    a = mx.random.normal(shape)
    mx.eval(a)
    return a


def test_graph_counts_count_every_call_of_a_compiled_function():
    # The calls of one mx.compile'd function share their primitives (same id in the dot export):
    # each call must still count.
    f = mx.compile(lambda a: mx.exp(a) * 2 + 1)
    a, b = evaluated(4), evaluated(4)
    counts = graph_counts([f(a), f(b), a + b], {})
    assert counts == {"CompiledExpBroadcastMultiplyBroadcastAdd": 2, "Add": 1}
    assert graph_counts([a], {}) == {}  # evaluated: nothing left to run


def test_primitive_id_is_the_array_s_own_producer_beside_unread_siblings():
    # A split's unread half is a sink of the graph too, before the array asked about.
    x = evaluated(4) * 2
    y = mx.split(x, 2)[0] + 1
    counts = graph_counts([y], {primitive_id(y): "the add"})
    assert counts == {"the add": 1, "Split": 1, "Multiply": 1, "Broadcast": 2}  # the scalars 2 and 1


def test_launches_whose_inputs_have_unread_siblings_keep_their_labels():
    # Each launch's first output is labelled by its own node, also when its inputs come from a
    # launch with two outputs of which one is not read yet (gear's Q(D) and residual).
    recorder = KernelRecorder()
    with cuda_path(recorder):
        two = mx.fast.cuda_kernel(name="two", input_names=["x"], output_names=["a", "b"], source="")
        one = mx.fast.cuda_kernel(name="one", input_names=["x"], output_names=["y"], source="")
        a, b = two(inputs=[evaluated(8) * 2], template=[], grid=(1, 1, 1), threadgroup=(1, 1, 1),
                   output_shapes=[(8,), (8,)], output_dtypes=[mx.float32, mx.float32])
        (y,) = one(inputs=[b], template=[], grid=(1, 1, 1), threadgroup=(1, 1, 1),
                   output_shapes=[(4,)], output_dtypes=[mx.float32])
        launched = {primitive_id(out): label for label, out in recorder.launches}
        assert graph_counts([y, a], launched) == {"CustomKernel:two": 1, "CustomKernel:one": 1, "Multiply": 1,
                                                   "Broadcast": 1}


def test_recorder_stands_in_for_launches_and_fused_ops():
    recorder = KernelRecorder()
    saved = mx.fast.cuda_kernel, mx.fast.scaled_dot_product_attention, mx.dequantize, mx.default_device
    with cuda_path(recorder):
        assert fused_decode.kernels_enabled() and mx.default_device() == mx.gpu
        kernel = mx.fast.cuda_kernel(name="probe", input_names=["x"], output_names=["y"], source="")
        x = evaluated(2, 3)
        (y,) = kernel(inputs=[x * 2], template=[], grid=(1, 1, 1), threadgroup=(1, 1, 1),
                      output_shapes=[(5,)], output_dtypes=[mx.float16])
        assert y.shape == (5,) and y.dtype == mx.float16
        q, k = evaluated(1, 4, 1, 64), evaluated(1, 2, 9, 64)
        one_row = mx.fast.scaled_dot_product_attention(q, k, k, scale=0.1)
        chunk = mx.fast.scaled_dot_product_attention(evaluated(1, 4, 3, 64), k, k, scale=0.1, mask="causal")
        w, s, z = mx.quantize(evaluated(4, 64), group_size=32, bits=4)
        mx.eval(w, s, z)
        deq = mx.dequantize(w, s, z, group_size=32, bits=4)
        assert deq.shape == (4, 64)
        launched = {primitive_id(out): label for label, out in recorder.launches}
        assert sorted(launched.values()) == ["CustomKernel:probe", "Dequantize", "ScaledDotProductAttention"]
        assert graph_counts([y], launched) == {"CustomKernel:probe": 1, "Multiply": 1, "Broadcast": 1}
        assert graph_counts([one_row], launched) == {"ScaledDotProductAttention": 1}
        assert graph_counts([deq], launched) == {"Dequantize": 1}
        # A 3-row chunk is not the fused one-row kernel on CUDA either: MLX's composition.
        assert "ScaledDotProductAttention" not in graph_counts([chunk], launched)
        mx.eval(y, one_row, deq)  # the stand-ins evaluate (to placeholders)
    assert (mx.fast.cuda_kernel, mx.fast.scaled_dot_product_attention, mx.dequantize, mx.default_device) == saved
    assert launches_of({"Broadcast": 3, "Reshape": 1, "Concatenate": 2, "CustomKernel:x": 1}) == 3


def test_census_command_end_to_end(tmp_path):
    """The command on a small history: fp16's step is mlx-lm's (2 slice writes, the fused
    attention), kivi's the compiled launch's counted kernel and its window's token written in
    place (2 slice writes, 2 views), as shipped on CUDA; xquant's follower
    builds what its leader builds; the JSON carries the ratios to fp16. In a subprocess: the
    census leaves mx.compile traces made under its stand-ins behind."""
    out = tmp_path / "census.json"
    done = subprocess.run(
        [sys.executable, "-m", "veloxquant_mlx.bench.step_census", "--methods", "xquant,fp16,kivi",
         "--layers", "2", "--history", "192", "--chunk", "96", "--steps", "40", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    methods = result["methods"]
    assert list(methods) == ["fp16", "xquant", "kivi"]  # the reference first
    fp16 = methods["fp16"]["layers"][0]["typical_step"]
    assert fp16 == {"ScaledDotProductAttention": 1, "Slice": 2, "SliceUpdate": 2}
    kivi = methods["kivi"]["layers"][0]["typical_step"]
    assert kivi == {"Slice": 2, "SliceUpdate": 2, "CustomKernel:vq_affine_decode_partials_merged_counted": 1}
    leader, follower = (layer["typical_step"] for layer in methods["xquant"]["layers"])
    assert leader == follower
    for r in methods.values():
        s = r["per_layer_step"]
        assert r["steps"] == 40 and s["host_syncs"] == 0 and s["unreached_launches"] == 0
        assert s["launches"] <= s["ops"] and s["build_us"]["p25"] <= s["build_us"]["median"] <= s["build_us"]["p75"]
        assert set(r["vs_fp16"]) == {"extra_ops", "extra_launches", "build_ratio", "build_ratio_mean"}
    # kivi's flush (block 32, residual 128) falls inside 40 steps: its encode kernel counted.
    assert methods["kivi"]["per_layer_step"]["primitives"].get("CustomKernel:vq_affine_encode_kv", 0) > 0
    assert "| fp16 |" in done.stdout and "| kivi |" in done.stdout


def test_unknown_method_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="unknown method"):
        step_census.run(step_census.parse_args(["--methods", "fp16,nope", "--out", str(tmp_path / "x.json")]))


def test_a_marked_ablation_is_its_methods_caches_marked(tmp_path):
    from veloxquant_mlx.bench.tiny import random_llama

    assert step_census.method_list("fp16, kivi-compiled") == ["fp16", "kivi-compiled"]
    with pytest.raises(ValueError, match=r"unknown method\(s\) \['gear-magnitude'\].*kivi-compiled"):
        step_census.method_list("gear-magnitude")  # an ablation with a class of its own: not taken
    model = random_llama(hidden=64, layers=2, intermediate=32, vocab=32)
    with step_census.method_caches("kivi-compiled", model) as (caches, _):
        assert [type(c).__name__ for c in caches] == ["KIVICache", "KIVICache"]
        assert all(c.compiled_launch and c.decode_window_in_place for c in caches)


def test_a_method_takes_fields_as_gpu_speed_does():
    """`minicache:minicache_start_fraction=0.0` (every layer paired) and a marked ablation with
    fields build their caches with those settings; a field the method has not, or a value out
    of range, is refused with the spec named, and fp16 takes none."""
    from veloxquant_mlx.bench.tiny import random_llama

    assert step_census.method_list("fp16,minicache:minicache_start_fraction=0.0,kivi-compiled:bit_width_inlier=4") == [
        "fp16", "minicache:minicache_start_fraction=0.0", "kivi-compiled:bit_width_inlier=4"]
    model = random_llama(hidden=64, layers=4, intermediate=32, vocab=32)
    with step_census.method_caches("minicache:minicache_start_fraction=0.0", model) as (caches, _):
        assert [c.role for c in caches] == ["lower", "upper", "lower", "upper"]
    with step_census.method_caches("minicache", model) as (caches, _):
        assert [c.role for c in caches] == ["plain", "plain", "lower", "upper"]
    with step_census.method_caches("kivi-compiled:bit_width_inlier=4", model) as (caches, _):
        assert all(c.compiled_launch and c.key_bits == c.value_bits == 4 for c in caches)
    with pytest.raises(ValueError, match=r"minicache:nope=1.*nope"):
        step_census.method_list("minicache:nope=1")
    with pytest.raises(ValueError, match="fp16 takes no parameters"):
        step_census.method_list("fp16:x=1")
