"""bench.fused_check: it compares a fused decode step with the portable one on the same cache (here
with the kernels emulated on the CPU and switched by VELOXQUANT_CUDA_KERNELS as on CUDA), refuses
what it cannot check, and off CUDA refuses instead of comparing the portable path with itself."""

import os

import pytest

from tests.cache import cuda_emulation
from veloxquant_mlx.bench import fused_check
from veloxquant_mlx.cache import fused_decode

pytestmark = pytest.mark.skipif(
    cuda_emulation.COMPILER is None, reason="needs g++ with C++20 std::barrier and _Float16 for the kernels' CPU emulation"
)


def test_each_step_compares_the_emulated_kernel_with_the_portable_path(monkeypatch):
    monkeypatch.setenv(fused_decode.ENV_SWITCH, "1")
    # As on CUDA: the switch decides (the check flips it between the two calls of a step).
    with cuda_emulation.emulated_kernels(
            enabled=lambda: os.environ.get(fused_decode.ENV_SWITCH, "1") == "1") as made:
        differences = fused_check.max_step_differences("kivi", steps=2)
    assert len(differences) == 2
    assert max(differences) < 2e-2  # bf16 outputs of two summation orders
    launched = {k.name: k.calls for k in made if k.calls}
    # One fused launch per step, compiled as shipped on CUDA: the counted build.
    assert launched == {"vq_affine_decode_partials_merged_counted": 2}


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
