"""Run fused_decode_rotated's CUDA kernel source on the CPU: a thread-level emulation.

The kernel body (fused_decode_rotated._PARTIALS, with its _HEADER) is compiled by g++ as a C++
template, wrapped in a shim that gives each of a block's 128 threads its own std::thread:
  * __syncthreads is a barrier of the block's 128 threads, __syncwarp one of the warp's 32;
  * __shfl_xor_sync writes the lane's value to a per-warp buffer, waits for the warp, reads the
    partner lane's value and waits again (every lane of a warp calls it, as in the kernel);
  * __shared__ arrays are function statics (one copy shared by the block's threads; blocks run
    one after another and the kernel writes its shared data before reading it);
  * __ldg, __funnelshift_r, __int_as_float, __uint_as_float, rsqrtf as their definitions.
Inputs are float32 (the kernel reads every side value through vq_f32, so float side data run
the same arithmetic); the fp16/bf16 load paths are left to the CUDA tests.

What this checks that the numpy reference cannot: the kernel's own indexing, bit reads, warp
reductions, online softmax, block merge and in-kernel (un)rotations, as written. What it cannot
check: CUDA-only semantics (memory coalescing, register spills, divergence costs), nvrtc's
acceptance of the source, and the fp16/bf16 conversions.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import numpy as np

from veloxquant_mlx.cache import fused_decode_rotated as fdr



def _cxx20_compiler() -> str | None:
    """g++ when it builds a C++20 program with std::barrier and threads (else None: the tests
    skip; a kernel source that fails to compile with a working compiler is a test failure)."""
    compiler = shutil.which("g++")
    if compiler is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        probe = Path(tmp) / "probe.cpp"
        probe.write_text("#include <barrier>\n#include <thread>\nint main() { std::barrier<> b(1); b.arrive_and_wait(); }\n")
        done = subprocess.run([compiler, "-std=c++20", "-pthread", str(probe), "-o", str(Path(tmp) / "probe")],
                              capture_output=True)
    return compiler if done.returncode == 0 else None


COMPILER = _cxx20_compiler()

_SHIM = r"""
#include <cstdint>
#include <cstring>
#include <cmath>
#include <algorithm>
#include <barrier>
#include <thread>
#include <vector>
using std::min; using std::max;
#define __device__
#define __forceinline__ inline
#define __global__
#define __shared__ static
#define __align__(x)
struct dim3v { unsigned x, y, z; };
thread_local dim3v threadIdx;
dim3v blockIdx, gridDim;
std::barrier<>* block_bar;
std::barrier<>* warp_bar[4];
float xbuf[4][32];
inline void __syncthreads() { block_bar->arrive_and_wait(); }
inline void __syncwarp() { warp_bar[threadIdx.x / 32]->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float x, int o) {
  const int w = threadIdx.x / 32, l = threadIdx.x % 32;
  xbuf[w][l] = x;
  warp_bar[w]->arrive_and_wait();
  const float y = xbuf[w][l ^ o];
  warp_bar[w]->arrive_and_wait();
  return y;
}
template <typename T> inline T __ldg(const T* p) { return *p; }
inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned s) {
  return (unsigned)((((unsigned long long)hi << 32) | lo) >> (s & 31));
}
inline float __int_as_float(int x) { float f; memcpy(&f, &x, 4); return f; }
inline float __uint_as_float(unsigned x) { float f; memcpy(&f, &x, 4); return f; }
inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }
// The header's fp16/bf16 overloads need the types; the emulation passes float32 only.
struct __half { unsigned short x; };
struct __nv_bfloat16 { unsigned short x; };
inline float __half2float(__half) { return 0.f; }
inline float __bfloat162float(__nv_bfloat16) { return 0.f; }
inline __half __float2half(float) { return __half{}; }
inline __nv_bfloat16 __float2bfloat16(float) { return __nv_bfloat16{}; }
"""

NAMES = ["q", "ksg", "vsg", "kmean", "kc1", "ks1", "kz1", "kc2", "km2",
         "vc1", "vs1", "vz1", "vc2", "vm2", "wk", "wv", "sk", "sv"]
CODE_INPUTS = {"kc1", "kc2", "vc1", "vc2"}
assert NAMES + ["meta"] == fdr._INPUTS


def _param(name: str) -> str:
    return f"const uint32_t* {name}" if name in CODE_INPUTS else f"const float* {name}"


def _entry(cfg: tuple[int, ...]) -> str:
    tag = "_".join(map(str, cfg))
    params = ", ".join(_param(n) for n in NAMES)
    return f"""
extern "C" void run_{tag}({params}, const int* meta, const int* wk_shape, const int* kc2_shape,
                          float* part_o, float* part_m, float* part_l, int n_blocks, int BH) {{
  gridDim = {{(unsigned)n_blocks, (unsigned)BH, 1}};
  std::barrier<> bb(128), w0(32), w1(32), w2(32), w3(32);
  block_bar = &bb; warp_bar[0] = &w0; warp_bar[1] = &w1; warp_bar[2] = &w2; warp_bar[3] = &w3;
  for (int by = 0; by < BH; ++by) for (int bx = 0; bx < n_blocks; ++bx) {{
    blockIdx = {{(unsigned)bx, (unsigned)by, 0}};
    std::vector<std::thread> threads;
    for (int t = 0; t < 128; ++t) threads.emplace_back([&, t] {{
      threadIdx = {{(unsigned)t, 0, 0}};
      partials<{", ".join(map(str, cfg))}, float>({", ".join(NAMES)}, meta, wk_shape, kc2_shape,
                                                 part_o, part_m, part_l);
    }});
    for (auto& th : threads) th.join();
  }}
}}
"""


@lru_cache(maxsize=None)
def compiled(configs: tuple[tuple[int, ...], ...]):
    """The emulation library for template configs (D, DV, R, KB1, VB1, KG, VG), compiled once."""
    header = fdr._HEADER.replace("#include <cuda_fp16.h>", "").replace("#include <cuda_bf16.h>", "")
    params = ", ".join(_param(n) for n in NAMES)  # QT = float: q, kmean, wk, wv are float too
    src = (_SHIM + header + "\ntemplate <int D, int DV, int R, int KB1, int VB1, int KG, int VG, typename QT>\n"
           f"void partials({params}, const int* meta, const int* wk_shape, const int* kc2_shape, "
           "float* part_o, float* part_m, float* part_l) {\n" + fdr._PARTIALS + "\n}\n"
           + "".join(_entry(c) for c in configs))
    build = Path(tempfile.mkdtemp(prefix="vq_cuda_emulation_"))
    (build / "kernel.cpp").write_text(src)
    subprocess.run([COMPILER, "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-w",
                    str(build / "kernel.cpp"), "-o", str(build / "kernel.so")], check=True)
    return ctypes.CDLL(str(build / "kernel.so"))


def run_partials(lib, cfg, arrays: list[np.ndarray], meta: np.ndarray, wk_shape, kc2_shape,
                 n_blocks: int, BH: int, R: int, DV: int):
    """(part_o, part_m, part_l) of the emulated kernel for the inputs in NAMES order."""
    arrays = [np.ascontiguousarray(a, dtype=np.uint32 if n in CODE_INPUTS else np.float32)
              for n, a in zip(NAMES, arrays)]
    part_o = np.zeros((BH, n_blocks, R, DV), np.float32)
    part_m = np.zeros((BH, n_blocks, R), np.float32)
    part_l = np.zeros((BH, n_blocks, R), np.float32)
    ints = [np.ascontiguousarray(x, dtype=np.int32) for x in (meta, wk_shape, kc2_shape)]
    ptr = lambda a: a.ctypes.data_as(ctypes.c_void_p)
    getattr(lib, "run_" + "_".join(map(str, cfg)))(
        *[ptr(a) for a in arrays], *[ptr(a) for a in ints], ptr(part_o), ptr(part_m), ptr(part_l),
        ctypes.c_int(n_blocks), ctypes.c_int(BH),
    )
    return part_o, part_m, part_l


def merge(part_o, part_m, part_l) -> np.ndarray:
    """fused_decode's merge kernel in numpy: (BH, R, DV)."""
    top = part_m.max(axis=1, keepdims=True)
    w = np.where(np.isneginf(part_m), 0.0, np.exp(part_m - top))
    return (w[..., None] * part_o).sum(1) / (w * part_l).sum(1)[..., None]
