"""The `<method>-verbatim` ablations (a cache's `kernel_text_as_written`): the fused decode launch
built from its kernel text as written, beside the shipped compacted one (cache/kernel_text.py), so
gpu_speed --interleave times what compacting saves. Checked without compiling: the emulation's
program text of each method's decode launch, both ways, from one model's caches."""

import contextlib

import mlx.core as mx
import pytest

from tests.cache.cuda_marks import cuda_test
from tests.cache.model_decode import assert_same_attention, decode_outputs, emulated_decode_launches
from veloxquant_mlx.bench.ablations import WINDOW_METHODS
from veloxquant_mlx.bench.layer_specs import parse_layer_spec
from veloxquant_mlx.cache import fused_decode
from veloxquant_mlx.cache.kernel_name import base_name
from veloxquant_mlx.cache.kernel_text import compact_kernel_text
from veloxquant_mlx.errors import QuantizerConfigError


def _decode_launches(method: str, verbatim: bool) -> list:
    """Every decode launch of one step, emulated, the caches' text switch set (uncompiled: the
    verbatim build is the plain launch's)."""
    return emulated_decode_launches(method, {"kernel_text_as_written": verbatim, "compiled_launch": False})


@pytest.mark.parametrize("method", WINDOW_METHODS)
def test_the_verbatim_launch_compiles_the_shipped_program_with_its_comments(method):
    shipped, verbatim = _decode_launches(method, False), _decode_launches(method, True)
    assert len(shipped) == len(verbatim) == (2 if method == "minicache" else 4)
    for (sk, ssig), (vk, vsig) in zip(shipped, verbatim):
        assert base_name(vk.name) == base_name(sk.name) + "_verbatim"
        assert ssig.template == vsig.template
        shipped_text, verbatim_text = sk.header + sk.source, vk.header + vk.source
        # The shipped text is the smaller by a third or more, and the same code once compacted
        # (so the same signature: MLX declares `x_shape` where the text names it, comments too).
        assert len(shipped_text) < 0.67 * len(verbatim_text)
        assert compact_kernel_text(vk.header) == sk.header and compact_kernel_text(vk.source) == sk.source
        assert vk._parameters(vsig)[0] == sk._parameters(ssig)[0]


def test_the_ablation_sets_the_caches_switch():
    spec = parse_layer_spec("kivi-verbatim")
    cache = spec.make(0, 1)
    assert spec.kind == "ablation" and cache.kernel_text_as_written is True and cache.compiled_launch is False


@pytest.mark.parametrize("other", [{"baked": True}, {"compiled": True}])
def test_the_verbatim_launch_refuses_the_other_launches(other):
    kernel = fused_decode.PartialsKernel("vq_test_partials", ["q"], "", "")
    with pytest.raises(QuantizerConfigError, match="text-as-written build"):
        kernel.attend(mx.zeros((1, 4, 1, 8)), inputs=[], template=[], n_blocks=1, heads=1, value_dim=8,
                      verbatim=True, **other)


@cuda_test
@pytest.mark.parametrize("method", WINDOW_METHODS)
def test_the_verbatim_launch_gives_the_shipped_launchs_output_on_the_gpu(method, monkeypatch):
    # The decode steps' launches only (the prefill's last chunk attends through the kernel too,
    # before the setting is made).
    launches, stepping = [], []
    attend = fused_decode.PartialsKernel.attend
    monkeypatch.setattr(fused_decode.PartialsKernel, "attend", lambda self, *a, **k: (
        stepping and launches.append(k.get("verbatim"))) or attend(self, *a, **k))

    @contextlib.contextmanager
    def steps():
        stepping.append(True)
        yield
        stepping.clear()

    # Both uncompiled (the verbatim build is the plain launch's); the text is what differs.
    shipped, _ = decode_outputs(method, {"kernel_text_as_written": False, "compiled_launch": False}, around=steps)
    verbatim, _ = decode_outputs(method, {"kernel_text_as_written": True, "compiled_launch": False}, around=steps)
    assert launches.count(True) == launches.count(False) == (2 if method == "minicache" else 4)
    assert_same_attention(shipped, verbatim)
