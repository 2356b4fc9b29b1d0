"""A tiny random llama's chunked prefill with minicache's CUDA prefill kernel on (emulated on the
CPU) against the portable path, bit for bit (see test_xquant_prefill_model.py)."""

from tests.cache.test_xquant_prefill_model import check_bit_for_bit, dispatch, emulation  # noqa: F401
from veloxquant_mlx import KVCacheConfig


@emulation
def test_minicache_prefill_with_the_kernel_is_the_portable_prefill(dispatch):
    config = KVCacheConfig(method="minicache", minicache_start_fraction=0.0)
    check_bit_for_bit(config, ["vq_merged_prefill_kv"])
