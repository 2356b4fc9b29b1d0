"""fused_decode.BAKED_CONSTANTS / a cache's `baked_constants` (the `<method>-baked` ablations):
a decode launch's template constants written into its kernel's source, as the lines MLX writes
for them, so the kernel compiled is the one the template gives. Checked without compiling: the
emulation's program text of each method's decode launch, both ways, from one model's caches."""

import mlx.core as mx
import pytest

from tests.cache.cuda_marks import cuda_test
from tests.cache.model_decode import assert_same_attention, decode_outputs, emulated_decode_launches
from veloxquant_mlx.bench.ablations import WINDOW_METHODS
from veloxquant_mlx.bench.layer_specs import parse_layer_spec
from veloxquant_mlx.cache import fused_decode
from veloxquant_mlx.cache.kernel_name import base_name
from veloxquant_mlx.errors import QuantizerConfigError


def test_constants_are_written_as_mlx_writes_them():
    template = [("D", 128), ("F", True), ("QT", mx.bfloat16), ("IT", mx.uint16), ("ST", mx.float16)]
    assert fused_decode.constants_source(template) == (
        "  constexpr int D = 128;\n  constexpr bool F = true;\n  using QT = __nv_bfloat16;\n"
        "  using IT = uint16_t;\n  using ST = __half;\n\n")
    assert fused_decode.constants_source([]) == ""


def test_a_constant_of_another_kind_is_refused_by_name():
    with pytest.raises(QuantizerConfigError, match=r"constant X=0\.5: allowed is an int, a bool"):
        fused_decode.constants_source([("D", 128), ("X", 0.5)])


def _decode_launches(method: str, baked: bool) -> list:
    """Every decode launch of one step, emulated, the caches' baked_constants set (uncompiled:
    a compiled launch takes its constants at its trace)."""
    return emulated_decode_launches(method, {"baked_constants": baked, "compiled_launch": False})


@pytest.mark.parametrize("method", WINDOW_METHODS)
def test_a_baked_launch_compiles_the_templated_kernel(method):
    plain, baked = _decode_launches(method, False), _decode_launches(method, True)
    # One decode launch per layer of ours (minicache: the merged pair's two layers).
    assert len(plain) == len(baked) == (2 if method == "minicache" else 4)
    for (pk, psig), (bk, bsig) in zip(plain, baked):
        assert psig.template and not bsig.template
        assert base_name(bk.name) == base_name(pk.name) + "_baked"
        assert (psig.input_dtypes, psig.input_ndims) == (bsig.input_dtypes, bsig.input_ndims)
        # The same program but for whitespace: MLX's template lines now open the source.
        assert " ".join(bk.program(bsig).split()) == " ".join(pk.program(psig).split())


def test_the_ablation_sets_the_caches_switch():
    spec = parse_layer_spec("gear-baked")
    assert spec.kind == "ablation" and spec.make(0, 1).baked_constants is True
    assert fused_decode.BAKED_CONSTANTS is False  # the shipped default stays the template


def test_the_split_launch_refuses_baked_constants(monkeypatch):
    monkeypatch.setattr(fused_decode, "MERGE_IN_KERNEL", False)
    kernel = fused_decode.PartialsKernel("vq_test_partials", ["q"], "", "")
    with pytest.raises(QuantizerConfigError, match="fused launch only; MERGE_IN_KERNEL is off"):
        kernel.attend(mx.zeros((1, 4, 1, 8)), inputs=[], template=[], n_blocks=1, heads=1, value_dim=8,
                      baked=True)


@cuda_test
@pytest.mark.parametrize("method", WINDOW_METHODS)
def test_a_baked_launch_gives_the_templated_launchs_output_on_the_gpu(method, monkeypatch):
    # NVRTC compiles the baked source for real: the same program, so the same attention out.
    launches = []
    attend = fused_decode.PartialsKernel.attend
    monkeypatch.setattr(fused_decode.PartialsKernel, "attend",
                        lambda self, *a, **k: launches.append(k.get("baked")) or attend(self, *a, **k))
    plain, _ = decode_outputs(method, {"baked_constants": False, "compiled_launch": False})
    baked, _ = decode_outputs(method, {"baked_constants": True, "compiled_launch": False})
    assert launches.count(True) == launches.count(False) == (2 if method == "minicache" else 4)
    assert_same_attention(plain, baked)
