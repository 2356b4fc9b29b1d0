"""The thread-level CUDA emulation itself (tests/cache/cuda_emulation.py): its primitives against
numpy and MLX, and its failures (a crash, CUDA's launch and shared-memory limits) as errors.

The kernel tests (test_fused_decode_emulated.py, test_fused_decode_rotated.py) trust these
primitives; here each is checked on its own, on a small kernel of two blocks of two warps.
"""

import mlx.core as mx
import numpy as np
import pytest

from tests.cache import cuda_emulation as emu

pytestmark = pytest.mark.skipif(
    emu.COMPILER is None, reason="needs g++ with C++20 std::barrier and _Float16 for the CPU emulation"
)

# Every output written by every thread but `odd`, which only even threads write (poison check).
PRIMITIVES = r"""
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  const float v = x[t];
  __shared__ float buf[BLOCK];
  buf[threadIdx.x] = v;
  __syncthreads();
  reversed[t] = buf[blockDim.x - 1 - threadIdx.x];
  shfl[t * 4 + 0] = __shfl_xor_sync(0xffffffffu, v, 5);
  shfl[t * 4 + 1] = __shfl_down_sync(0xffffffffu, v, 3);
  shfl[t * 4 + 2] = __shfl_up_sync(0xffffffffu, v, 2);
  shfl[t * 4 + 3] = __shfl_sync(0xffffffffu, v, 7);
  float s = v;
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  warp_sum[t] = s;
  ids[t * 4 + 0] = x_shape[0] * SCALE;
  ids[t * 4 + 1] = gridDim.x;
  ids[t * 4 + 2] = blockDim.x;
  ids[t * 4 + 3] = threadIdx.x + 1000 * blockIdx.x;
  to_half[t] = __float2half(v);
  to_bf16[t] = __float2bfloat16(v);
  from_16[t] = OT(__half2float(h[t]) + __bfloat162float(b[t]));
  if (t % 2 == 0) odd[t] = v;
"""
N, BLOCK = 128, 64


def _primitives_kernel():
    return emu.cuda_kernel("primitives", ["x", "h", "b"],
                           ["reversed", "shfl", "warp_sum", "ids", "to_half", "to_bf16", "from_16", "odd"],
                           PRIMITIVES)


def _run_primitives(kernel, x, init_value=None):
    h = (x * 3).astype(mx.float16)
    b = (x * 5).astype(mx.bfloat16)
    return kernel(inputs=[x, h, b], template=[("BLOCK", BLOCK), ("SCALE", 10), ("OT", mx.float32)],
                  grid=(N, 1, 1), threadgroup=(BLOCK, 1, 1),
                  output_shapes=[(N,), (N, 4), (N,), (N, 4), (N,), (N,), (N,), (N,)],
                  output_dtypes=[mx.float32, mx.float32, mx.float32, mx.int32, mx.float16, mx.bfloat16,
                                 mx.float32, mx.float32],
                  init_value=init_value), h, b


def test_primitives_are_cudas():
    mx.random.seed(0)
    x = mx.random.normal((N,)) * 100  # values whose fp16 / bf16 roundings differ from truncation
    kernel = _primitives_kernel()
    (rev, shfl, wsum, ids, to_half, to_bf16, from_16, odd), h, b = _run_primitives(kernel, x)
    xs = np.array(x)
    t = np.arange(N)
    lane, block_start = t % 32, t // BLOCK * BLOCK
    assert np.array_equal(np.array(rev), xs[block_start + BLOCK - 1 - t % BLOCK])  # __syncthreads + shared
    shfl = np.array(shfl)
    warp_start = t - lane
    assert np.array_equal(shfl[:, 0], xs[warp_start + (lane ^ 5)])
    assert np.array_equal(shfl[:, 1], xs[np.where(lane + 3 < 32, t + 3, t)])  # past the warp: own value
    assert np.array_equal(shfl[:, 2], xs[np.where(lane >= 2, t - 2, t)])
    assert np.array_equal(shfl[:, 3], xs[warp_start + 7])
    assert np.allclose(np.array(wsum), xs.reshape(-1, 32).sum(1).repeat(32), rtol=1e-5, atol=1e-3)
    assert np.array(ids).tolist() == [[N * 10, N // BLOCK, BLOCK, i % BLOCK + 1000 * (i // BLOCK)] for i in range(N)]
    # Conversions: exact, and rounding to nearest even as MLX's astype does.
    assert to_half.dtype == mx.float16 and mx.array_equal(to_half, x.astype(mx.float16)).item()
    assert to_bf16.dtype == mx.bfloat16 and mx.array_equal(to_bf16, x.astype(mx.bfloat16)).item()
    assert np.array_equal(np.array(from_16), np.array(h.astype(mx.float32) + b.astype(mx.float32)))
    # An element the kernel does not write is NaN (uninitialized memory, poisoned) ...
    odd = np.array(odd)
    assert np.array_equal(odd[::2], xs[::2]) and np.isnan(odd[1::2]).all()
    # ... or init_value where the caller asks for one, as MLX does.
    (*_, odd), _, _ = _run_primitives(kernel, x, init_value=-1.0)
    assert np.array_equal(np.array(odd)[1::2], -np.ones(N // 2))
    assert kernel.calls == 2


def test_a_crashing_kernel_is_an_error_naming_it():
    kernel = emu.cuda_kernel("crash", ["x"], ["y"], "volatile float* p = nullptr; if (threadIdx.x == 3) *p = x[0];\ny[0] = 1;")
    with pytest.raises(emu.EmulationError, match="emulated kernel 'crash' failed with exit status"):
        kernel(inputs=[mx.zeros((4,))], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(1,)],
               output_dtypes=[mx.float32])


def test_launch_limits_and_shared_memory_are_cudas():
    kernel = emu.cuda_kernel("big", ["x"], ["y"], "__shared__ float s[SIZE];\ns[threadIdx.x] = x[0];\ny[0] = s[0];")
    call = lambda size, threads=32, grid=32: kernel(
        inputs=[mx.zeros((1,))], template=[("SIZE", size)], grid=(grid, 1, 1), threadgroup=(threads, 1, 1),
        output_shapes=[(1,)], output_dtypes=[mx.float32])
    with pytest.raises(emu.EmulationError, match="exceeds CUDA's 1024 threads per block"):
        call(64, threads=2048, grid=2048)
    with pytest.raises(emu.EmulationError, match="must be 3 positive ints"):
        call(64, grid=0)
    with pytest.raises(emu.EmulationError, match="must be 3 positive ints"):
        call(64, threads=0)
    with pytest.raises(emu.EmulationError, match=r"declares 49156 bytes of __shared__ memory; CUDA allows 49152"):
        call(12289)
    assert np.array(call(12288)[0]).tolist() == [0.0]  # exactly 48 KB runs
