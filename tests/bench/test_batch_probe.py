"""bench.batch_probe: its variants still cut today's kernel sources, and it refuses what it cannot
time (the timing itself needs MLX's CUDA backend: run on the H200)."""

import importlib

import pytest

from veloxquant_mlx.bench import batch_probe
from veloxquant_mlx.errors import QuantizerConfigError


def test_every_variant_cuts_todays_sources_and_changes_them():
    batch_probe.check_variants()
    for method, (module_name, attribute, variants) in batch_probe.VARIANTS.items():
        source = getattr(importlib.import_module(module_name), attribute)
        for name, (cuts, constants) in variants.items():
            cut = batch_probe.variant_source(source, cuts)
            # a cut variant differs from the shipped source; a constants variant is the source itself
            assert (cut != source) == bool(cuts), (method, name)
            assert cuts or constants or name == "shipped", (method, name)


def test_a_cut_that_no_longer_applies_is_refused():
    with pytest.raises(QuantizerConfigError, match="no longer holds"):
        batch_probe.variant_source("int x;", [("for (int b0 = 0;", "")])


def test_off_cuda_it_refuses_before_timing(capsys):
    assert batch_probe.main(["--contexts", "64", "--methods", "kvquant", "--no-openblas"]) == 2
    assert "needs MLX's CUDA backend" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--methods", "minicache"], ["--methods", "nope"], ["--contexts", "0"],
                                  ["--contexts", "x"]])
def test_bad_options_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        batch_probe.parse_args(argv)
    assert exc.value.code == 2
    assert "allowed" in capsys.readouterr().err


def test_every_variant_module_has_the_kernel_cache_a_variant_clears():
    for module_name, _, _ in batch_probe.VARIANTS.values():
        assert callable(batch_probe.kernel_cache(importlib.import_module(module_name)).cache_clear), module_name


def test_an_unknown_variant_name_is_a_usage_error_naming_it(capsys):
    with pytest.raises(SystemExit):
        batch_probe.parse_args(["--variants", "mma,nosuch"])
    err = capsys.readouterr().err
    assert "nosuch" in err and "novalue" in err


def test_variants_keep_the_named_ones():
    assert batch_probe.parse_args(["--variants", "mma,ksl"]).variants == ["mma", "ksl"]
    assert batch_probe.parse_args([]).variants is None


def test_launch_variants_patch_the_fused_launch_and_every_kernel_header_then_restore(monkeypatch):
    import mlx.core as mx

    from veloxquant_mlx.cache import fused_decode, fused_decode_gear, kernel_header, partials_merge_source

    built = []  # a stand-in for mx.fast.cuda_kernel (absent off CUDA): the headers kernels get
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **kw: built.append(kw["header"]), raising=False)

    shipped = (partials_merge_source.FUSED_PROLOGUE, partials_merge_source.FUSED_EPILOGUE, fused_decode._HEADER,
               fused_decode_gear._HEADER)
    group = f"constexpr int VQ_MERGE_GROUP = {kernel_header.MERGE_GROUP};"
    with batch_probe.launch_variant("nomerge"):
        epilogue = partials_merge_source.FUSED_EPILOGUE
        assert "vq_merge_if_last" not in epilogue and "#undef part_o" in epilogue
        assert partials_merge_source.FUSED_PROLOGUE == shipped[0]
    with batch_probe.launch_variant("empty"):
        prologue = partials_merge_source.FUSED_PROLOGUE
        assert prologue.startswith(shipped[0]) and "return;" in prologue
        assert "vq_merge_if_last" not in partials_merge_source.FUSED_EPILOGUE
    with batch_probe.launch_variant("onelevel"):
        for header in (fused_decode._HEADER, fused_decode_gear._HEADER):
            assert group not in header and f"VQ_MERGE_GROUP = {1 << 30};" in header
        assert partials_merge_source.FUSED_EPILOGUE == shipped[1]
        fused_decode._kernels()[0].fused  # built within the variant, with its header ...
        assert f"VQ_MERGE_GROUP = {1 << 30};" in built[-1]
    assert fused_decode._kernels.cache_info().currsize == 0  # ... and not kept after it
    with batch_probe.launch_variant("group8"):  # the kernel's groups and the launch's sizes agree
        assert "VQ_MERGE_GROUP = 8;" in fused_decode._HEADER and kernel_header.MERGE_GROUP == 8
        assert fused_decode.merge_counters(2, 17) == 2 * (1 + 3)
    assert kernel_header.MERGE_GROUP == 16 and fused_decode.merge_counters(2, 17) == 2 * (1 + 2)
    assert (partials_merge_source.FUSED_PROLOGUE, partials_merge_source.FUSED_EPILOGUE, fused_decode._HEADER,
            fused_decode_gear._HEADER) == shipped


def test_a_launch_variant_whose_merge_is_gone_is_refused():
    with pytest.raises(QuantizerConfigError, match="no longer holds the merge"):
        batch_probe.launch_variant_sources("nomerge", "", "#undef part_o\n", {})
    with pytest.raises(QuantizerConfigError, match="allowed: nomerge, empty, onelevel, group8, group32"):
        batch_probe.launch_variant_sources("nope", "", "  vq_merge_if_last<R, DV>(a);\n", {})


def test_launch_variants_are_known_names():
    assert batch_probe.parse_args(["--variants", "nomerge,onelevel"]).variants == ["nomerge", "onelevel"]
