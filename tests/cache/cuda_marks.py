"""The mark of a test that needs MLX's CUDA backend (our kernels run for real there).

`cuda_only` marks a test `cuda` and skips it elsewhere, so a device call runs exactly the
kernel tests with `pytest -m cuda tests/cache` instead of whole files: on the H200 the
emulated and portable tests of those files took most of a 560 s call in session 5 and cut
the CUDA ones short.
"""

import pytest

from veloxquant_mlx.cache import fused_decode

on_cuda = fused_decode._on_cuda()
cuda_only = pytest.mark.skipif(not on_cuda, reason="needs MLX's CUDA backend (run on the H200: pytest -m cuda)")


def cuda_test(test):
    """Decorator: the test is marked `cuda` and skipped off CUDA."""
    return pytest.mark.cuda(cuda_only(test))
