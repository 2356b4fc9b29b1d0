"""bench.launch_bounds_probe: the header it gives the decode kernels, the wrapper that applies
it to those kernels only, and its refusals (the timing itself needs MLX's CUDA backend)."""

import mlx.core as mx
import pytest

from veloxquant_mlx.bench import launch_bounds_probe as probe
from veloxquant_mlx.cache import fused_decode, fused_decode_rotated


def test_bounded_header_appends_the_bounds_or_resets_the_declaration():
    assert probe.bounded_header("H", 6) == "H" + fused_decode.launch_bounds_header(6)
    reset = probe.bounded_header("H", 0)
    assert reset.startswith("H") and "#define __global__ __location__(global)\n" in reset
    assert "__launch_bounds__" not in reset and "defined(__CUDACC_RTC__)" in reset


def test_the_wrapper_bounds_decode_partials_kernels_only_and_rebuilds_the_factories(monkeypatch):
    made = []
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **kw: made.append(kw) or kw["name"])
    fused_decode_rotated._partials_kernel(32, 5)
    assert fused_decode_rotated._partials_kernel.cache_info().currsize == 1
    with probe.bounded_kernels(5):
        assert fused_decode_rotated._partials_kernel.cache_info().currsize == 0  # emptied on entry
        mx.fast.cuda_kernel(name="vq_affine_decode_partials_merged__srcabc", header="H", source="s")
        mx.fast.cuda_kernel(name="vq_affine_decode_merge__srcdef", header="H", source="s")
        fused_decode_rotated._partials_kernel(32, 5)
    assert fused_decode_rotated._partials_kernel.cache_info().currsize == 0  # and on exit
    partials, merge = made
    assert partials["name"].endswith("_lb5") and "__launch_bounds__(128, 5)" in partials["header"]
    assert merge == {"name": "vq_affine_decode_merge__srcdef", "header": "H", "source": "s"}
    assert mx.fast.cuda_kernel(name="vq_x_decode_partials", header="H") == "vq_x_decode_partials"  # restored


def test_off_cuda_it_refuses_before_timing(capsys):
    assert probe.main(["--context", "64", "--methods", "kivi", "--no-openblas"]) == 2
    assert "needs MLX's CUDA backend" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--methods", "minicache"], ["--methods", ","], ["--bounds", "17"],
                                  ["--bounds", "-1"], ["--bounds", "x"], ["--context", "0"],
                                  ["--warps", "0"], ["--warps", "1024,x"]])
def test_bad_options_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        probe.parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "allowed" in err or "invalid" in err, err


@pytest.mark.parametrize("text, says", [("fused_decode.MMA_SCORES", "expected MODULE.NAME=VALUE"),
                                        ("nomodule.X=1", "no module veloxquant_mlx.cache.nomodule")])
def test_a_bad_setting_is_a_usage_error_naming_it(text, says, capsys):
    with pytest.raises(SystemExit) as exc:
        probe.parse_args(["--set", text])
    assert exc.value.code == 2 and says in capsys.readouterr().err


def test_set_takes_a_cache_modules_constant_and_warps_a_list():
    args = probe.parse_args(["--set", "fused_decode.MMA_SCORES=1", "--methods", "kivi,gear", "--warps", "1024,4096"])
    assert len(args.set) == 1 and args.methods == ["kivi", "gear"] and args.warps == [1024, 4096]
    assert probe.parse_args([]).warps == []
