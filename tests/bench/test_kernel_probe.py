"""bench.kernel_probe: its kernel variants are cut from the shipped source at markers that must
exist, and off CUDA it refuses with a usage error instead of timing nothing."""

import pytest

from tests.cache import cuda_emulation
from veloxquant_mlx.bench import kernel_probe
from veloxquant_mlx.cache import compiled_launch, fused_decode


def test_variants_cut_one_half_of_the_shipped_kernel():
    full = kernel_probe.variant_source("full")
    assert full == fused_decode._PARTIALS
    noscore, novalue = kernel_probe.variant_source("noscore"), kernel_probe.variant_source("novalue")
    key_read, value_read = "kstage[warp][dd * WR + lane_word]", "words[k][i] = row[i]"
    assert key_read in full and key_read not in noscore and key_read in novalue
    assert value_read in full and value_read not in novalue and value_read in noscore
    assert "online softmax" in noscore and "online softmax" in novalue
    neither = kernel_probe.variant_source("noscore+novalue")
    assert key_read not in neither and value_read not in neither and "online softmax" in neither
    # Substitution variants: each changes the shipped source where it says.
    assert "#pragma unroll 1\n        for (int b0 = 0; b0 < VST / TPR" in full
    assert "#pragma unroll\n        for (int b0 = 0; b0 < VST / TPR" in kernel_probe.variant_source("unrolled")
    assert "vq_u2f(code)" in kernel_probe.variant_source("u2f") and "vq_u2f(code)" not in full
    assert "0x3F800000u" in kernel_probe.variant_source("unit")
    assert "const int last = window ? 0 : min(first + per_block, n_valid);" in kernel_probe.variant_source("nowindow")
    assert "n_window) : first;" in kernel_probe.variant_source("windowonly")
    with pytest.raises(ValueError, match="allowed are full, unrolled, nowindow, windowonly, u2f, unit, or of noscore, novalue"):
        kernel_probe.variant_source("half")


def test_off_cuda_it_is_a_usage_error(capsys):
    if fused_decode._on_cuda():
        pytest.skip("this machine runs MLX on CUDA: the probe would run")
    assert kernel_probe.main(["--parts", "read", "--no-openblas"]) == 2
    assert "needs MLX's CUDA backend" in capsys.readouterr().err


def test_parts_are_checked():
    with pytest.raises(SystemExit):
        kernel_probe.parse_args(["--parts", "read,everything"])


@pytest.mark.skipif(cuda_emulation.COMPILER is None, reason="needs g++ with C++20 std::barrier for the CUDA emulation")
def test_the_probes_launch_runs_every_variant_and_the_full_one_is_the_attention(monkeypatch):
    # The probe times variants through fused_decode.affine_partials (the shipped launch); run by
    # the CPU emulation of mx.fast.cuda_kernel, the full variant merged is the cache's portable
    # attention over everything but the sink's placeholder (the probe attends that column).
    import mlx.core as mx

    monkeypatch.setattr(mx.fast, "cuda_kernel", cuda_emulation.cuda_kernel)
    fused_decode._kernels.cache_clear()
    try:
        cache, _, _, _, q = kernel_probe._filled_kivi(600)
        cache.sink_keys = cache.sink_values = None  # column 0 read from its codes, as the probe does
        # float32 queries: the CPU's portable path in bf16 rounds its scores (see
        # tests/cache/test_fused_decode_emulated.py); the kernels accumulate in float32.
        expected = cache.attention(q.astype(mx.float32), scale=kernel_probe.D**-0.5)
        split = {}
        for mode in ("full", "noscore", "novalue", "noscore+novalue", "unrolled", "u2f", "unit", "nowindow", "windowonly"):
            parts = kernel_probe._partials_call(kernel_probe.variant_kernel(mode), cache, q, 4096)()
            mx.eval(parts)
            assert parts[0].shape[:3] == (8, parts[1].shape[1], 4)
            # Blocks with no tokens (the exact one, or the history's) leave a max of -inf.
            kept = {"nowindow": parts[1][:, :-1], "windowonly": parts[1][:, -1:]}.get(mode, parts[1])
            assert mx.isfinite(kept).all().item()
            if mode in ("nowindow", "windowonly"):
                assert not mx.isfinite(parts[1]).all().item()
                split[mode] = parts
            if mode in ("full", "unrolled", "u2f", "unit"):  # the same attention, other code
                got = fused_decode.merge_partials(*parts, q).astype(mx.float32)
                assert mx.allclose(got, expected, atol=1e-2, rtol=1e-2).item(), mx.abs(got - expected).max().item()
        # The history blocks of one and the exact block of the other are the whole attention.
        joined = [mx.concatenate([h[:, :-1], w[:, -1:]], axis=1) for h, w in zip(split["nowindow"], split["windowonly"])]
        got = fused_decode.merge_partials(*joined, q).astype(mx.float32)
        assert mx.allclose(got, expected, atol=1e-2, rtol=1e-2).item(), mx.abs(got - expected).max().item()
        # The shipped kernel with the exact block's rows 16 bytes a load (partials_full_row_vectors).
        got = fused_decode.merge_partials(*kernel_probe._partials_call(None, cache, q, 4096, row_vectors=1)(), q)
        assert mx.allclose(got.astype(mx.float32), expected, atol=1e-2, rtol=1e-2).item()
        assert fused_decode.WINDOW_ROW_VECTORS == 0  # restored after the call
        # ... and with the history's scores on tensor cores (partials_full_mma).
        got = fused_decode.merge_partials(*kernel_probe._partials_call(None, cache, q, 4096, mma=1)(), q)
        assert mx.allclose(got.astype(mx.float32), expected, atol=1e-2, rtol=1e-2).item()
        assert fused_decode.MMA_SCORES == 1  # restored after the call (on as shipped since session 30)
        # The shipped launch the probe times as fused_full: the merge fused in, the attention out.
        fused = kernel_probe._partials_call(None, cache, q, 4096, merged=True)
        for _ in range(2):  # two launch states of the probe's pool in turn, each left ready
            got = fused().astype(mx.float32)
            assert mx.allclose(got, expected, atol=1e-2, rtol=1e-2).item(), mx.abs(got - expected).max().item()
        # Chained (fused_chain_*): one launch state, each launch taking the last one's output.
        made = []

        class Recorded(fused_decode.FusedLaunchState):
            def __init__(self):
                super().__init__()
                made.append(self)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(fused_decode, "FusedLaunchState", Recorded)
            chained = kernel_probe._partials_call(None, cache, q, 2048, merged=True, chained=True)
        outs = [chained() for _ in range(3)]
        assert len(made) == 1 and made[0].last_out is outs[-1]
        for got in outs:
            got = got.astype(mx.float32)
            assert mx.allclose(got, expected, atol=1e-2, rtol=1e-2).item(), mx.abs(got - expected).max().item()
    finally:
        fused_decode._kernels.cache_clear()


@pytest.mark.skipif(cuda_emulation.COMPILER is None, reason="needs g++ with C++20 std::barrier for the CUDA emulation")
def test_the_step_probe_times_whole_steps_and_kivis_pieces(monkeypatch):
    # Under the CPU emulation (kernels "on"): every spec gets a step time, kivi its sink
    # concatenation, partials and merge; each timed call really ran (finite, positive ms).
    import mlx.core as mx

    from veloxquant_mlx.bench.layer_specs import parse_layer_spec

    monkeypatch.setattr(mx.fast, "cuda_kernel", cuda_emulation.cuda_kernel)
    monkeypatch.setattr(fused_decode, "_on_cuda", lambda: True)
    # The emulation runs eagerly and cannot be traced (the compiled launch as shipped on CUDA).
    monkeypatch.setattr(compiled_launch, "compile_function", lambda function: function)
    real = kernel_probe.per_call_ms
    monkeypatch.setattr(kernel_probe, "per_call_ms",
                        lambda fn, calls=30, batches=5, build_untimed=False: real(fn, 2, 1, build_untimed))
    fused_decode._kernels.cache_clear()
    try:
        got = kernel_probe.probe_step(300, [parse_layer_spec("fp16"), parse_layer_spec("kivi")])
    finally:
        fused_decode._kernels.cache_clear()
    assert set(got) == {"fp16_step_ms", "kivi_step_ms", "kivi_sink_concat_ms", "kivi_partials_ms", "kivi_merge_ms"}
    assert all(0 < ms < 60_000 for ms in got.values()), got


def test_step_methods_are_checked():
    with pytest.raises(SystemExit):
        kernel_probe.parse_args(["--parts", "step", "--methods", "fp16,nonesuch"])


def test_set_names_an_integer_constant_of_a_cache_module_or_is_refused(capsys):
    from veloxquant_mlx.bench import constants
    from veloxquant_mlx.cache import prefill_pieces

    module, name, value = constants.parse_setting("fused_decode.TARGET_WARPS=2048")
    assert module is fused_decode and name == "TARGET_WARPS" and value == 2048
    assert constants.parse_setting("fused_decode_codebook.PARK_ACCUMULATORS=0")[2] is False
    for bad, said in [("fused_decode.TARGET_WARPS", "expected MODULE.NAME=VALUE"),
                      ("nosuch.X=1", "no module veloxquant_mlx.cache.nosuch"),
                      ("fused_decode.NO_SUCH=1", "has no integer or boolean constant NO_SUCH"),
                      ("fused_decode.TARGET_WARPS=many", "'many' is not an integer"),
                      ("fused_decode_codebook.PARK_ACCUMULATORS=yes", "is a boolean: allowed are 0 and 1")]:
        with pytest.raises(ValueError, match=said):
            constants.parse_setting(bad)
    with pytest.raises(SystemExit):
        kernel_probe.parse_args(["--set", "fused_decode.NO_SUCH=1"])
    assert "--set: 'fused_decode.NO_SUCH=1'" in capsys.readouterr().err
    # Applied, the run records the default beside the setting.
    saved = prefill_pieces.SYNC
    try:
        applied = constants.apply_settings([constants.parse_setting("prefill_pieces.SYNC=0")])
        assert prefill_pieces.SYNC == 0
        assert applied == {"veloxquant_mlx.cache.prefill_pieces.SYNC": {"default": saved, "set": 0}}
    finally:
        prefill_pieces.SYNC = saved


def test_chained_calls_each_follow_the_last():
    # fp16_sdpa_chain_ms's calls: each call's input depends on the last call's output, so the
    # graph of the third output holds all three calls (independent calls: one each).
    import mlx.core as mx

    from veloxquant_mlx.bench.step_census import graph_nodes

    q = mx.zeros((4,))
    mx.eval(q)
    call = kernel_probe._chained(lambda x: mx.exp(x), q)
    outs = [call() for _ in range(3)]
    assert [name for _, name in graph_nodes([outs[2]])].count("Exp") == 3
    assert mx.array_equal(outs[2], mx.ones((4,))).item()  # no arithmetic on the input
    assert [name for _, name in graph_nodes([mx.exp(q)])].count("Exp") == 1
