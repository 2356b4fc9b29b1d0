"""bench.fused_check: it compares a fused decode step with the portable one on the same cache (here
with the kernels emulated on the CPU and switched by VELOXQUANT_CUDA_KERNELS as on CUDA), refuses
what it cannot check, and off CUDA refuses instead of comparing the portable path with itself."""

import mlx.core as mx
import pytest

from tests.cache import cuda_emulation
from veloxquant_mlx.bench import fused_check
from veloxquant_mlx.cache import fused_decode
from veloxquant_mlx.cache.kernel_name import base_name

pytestmark = pytest.mark.skipif(
    cuda_emulation.COMPILER is None, reason="needs g++ with C++20 std::barrier and _Float16 for the kernels' CPU emulation"
)


def test_each_step_compares_the_emulated_kernel_with_the_portable_path(monkeypatch):
    launched = []

    def build(*args, **kwargs):
        kernel = cuda_emulation.cuda_kernel(*args, **kwargs)

        def launch(**call):
            launched.append(base_name(kwargs["name"]))
            return kernel(**call)
        return launch

    builders = cuda_emulation.kernel_builders()
    for built in builders:
        built.cache_clear()
    monkeypatch.setattr(mx.fast, "cuda_kernel", build, raising=False)
    # As on CUDA: the switch decides (the check flips it between the two calls of a step).
    monkeypatch.setattr(fused_decode, "kernels_enabled",
                        lambda: fused_decode.os.environ.get(fused_decode.ENV_SWITCH, "1") == "1")
    monkeypatch.setenv(fused_decode.ENV_SWITCH, "1")
    try:
        differences = fused_check.max_step_differences("kivi", steps=2)
    finally:
        for built in builders:
            built.cache_clear()
    assert len(differences) == 2
    assert max(differences) < 2e-2  # bf16 outputs of two summation orders
    assert launched.count("vq_affine_decode_partials_merged") == 2  # one fused launch per step


def test_it_refuses_what_it_cannot_check(capsys):
    with pytest.raises(SystemExit):
        fused_check.main(["--methods", "kivi,minicache"])
    assert "['minicache'] not checkable" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        fused_check.main(["--methods", "kivi", "--steps", "0"])
    assert "--steps 0" in capsys.readouterr().err


def test_off_cuda_it_refuses(capsys, monkeypatch):
    monkeypatch.setattr(fused_decode, "_on_cuda", lambda: False)
    assert fused_check.main(["--methods", "kivi"]) == 2
    assert "needs MLX's CUDA backend" in capsys.readouterr().err
