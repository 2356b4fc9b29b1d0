"""bench/pair_probe.py off CUDA: every case builds one decode row of attention, fp16's two forms
and a plain minicache layer attend the same values, the pair holds a merged history, and the
command refuses to time anything off MLX's CUDA backend."""

import mlx.core as mx
import pytest

from veloxquant_mlx.bench import pair_probe


def test_cases_attend_one_decode_row_and_the_pair_is_merged():
    built = pair_probe.cases(300)
    assert tuple(built) == pair_probe.CASES
    outs = {name: fn() for name, fn in built.items()}
    mx.eval(list(outs.values()))
    for out in outs.values():
        assert out.shape == (1, pair_probe.HQ, 1, pair_probe.D) and out.dtype == mx.bfloat16
    # mlx-lm's KVCache views and a plain minicache layer hold the same K/V as the contiguous arrays.
    assert mx.array_equal(outs["fp16_kvcache"], outs["fp16_contiguous"]).item()
    assert mx.array_equal(outs["minicache_plain"], outs["fp16_contiguous"]).item()
    # The paired layers read merged directions: close to, not equal to, the exact attention.
    assert not mx.array_equal(outs["minicache_lower"], outs["fp16_contiguous"]).item()


def test_kvcache_views_skip_the_buffers_unused_rows():
    k, v = pair_probe.layer_tensors(4096, 0)
    keys, values = pair_probe.kvcache_views(k, v)
    assert keys.shape == values.shape == (1, pair_probe.HK, 4097, pair_probe.D)
    assert mx.array_equal(keys, k).item() and mx.array_equal(values, v).item()


def test_off_cuda_it_refuses_before_timing(capsys):
    from veloxquant_mlx.bench.kernel_probe import on_cuda

    if on_cuda():
        pytest.skip("MLX's CUDA backend: nothing to refuse")
    assert pair_probe.main(["--contexts", "2048", "--no-openblas"]) == 2
    assert "needs MLX's CUDA backend" in capsys.readouterr().err


@pytest.mark.parametrize("contexts", ["100", "x", ""])
def test_bad_contexts_are_usage_errors(contexts, capsys):
    with pytest.raises(SystemExit) as exc:
        pair_probe.parse_args(["--contexts", contexts])
    assert exc.value.code == 2 and "--contexts" in capsys.readouterr().err


def test_a_variant_rebuilds_the_kernel_with_its_settings_and_restores_them():
    from veloxquant_mlx.cache import fused_decode_merged as module

    built = pair_probe.cases(300)
    shipped = (module._HEADER, module.TARGET_WARPS, module.PREFETCH_FIRST_VALUES)
    with pair_probe.merged_variant("lb3", built.caches):
        assert module._HEADER.startswith(shipped[0]) and "__launch_bounds__(128, 3)" in module._HEADER
    with pair_probe.merged_variant("noprefetch", built.caches):
        assert module.PREFETCH_FIRST_VALUES is False and module._HEADER == shipped[0]
        mx.eval(built["minicache_upper"]())  # the pair attends under the variant (here: the portable path)
    assert (module._HEADER, module.TARGET_WARPS, module.PREFETCH_FIRST_VALUES) == shipped
    assert all("_fused_plan" not in c.__dict__ for c in built.caches)


def test_an_unknown_variant_is_a_usage_error_naming_it(capsys):
    with pytest.raises(SystemExit) as exc:
        pair_probe.parse_args(["--variants", "lb3,nope"])
    assert exc.value.code == 2 and "nope" in capsys.readouterr().err
