"""Run our CUDA kernel sources on the CPU: a thread-level emulation of mx.fast.cuda_kernel.

`cuda_kernel(name, input_names, output_names, source, header)` takes the arguments
mx.fast.cuda_kernel takes and returns a callable with the call signature of MLX's kernels
(inputs, template, grid, threadgroup, output_shapes, output_dtypes, init_value): a test can
monkeypatch it in place of mx.fast.cuda_kernel and run a cache's whole decode step, kernel
arguments as the caller builds them, on the CPU.

The kernel function is generated as MLX's CUDA backend generates it (mlx/backend/cuda/
custom_kernel.cpp, build_kernel): one parameter `const T* name` per input in its dtype's type,
`name_shape` (int32), `name_strides` (int64) and `name_ndim` only where the source mentions them
(MLX's substring test), one `T* name` per output, then `constexpr int X = v;` / `using X = T;`
per template argument, then the source. MLX's header (`inf`, cooperative_groups) is reduced to
`inf`. It is compiled by g++ (C++20) with a shim, into a small program run in a subprocess (a
crash or a hang is a test failure with the program's message, not a dead test session):
  * each block's threads are std::threads, one per CUDA thread; blocks run one after another;
  * __syncthreads is a barrier of the block's threads, __syncwarp one of the warp's lanes;
  * warp shuffles (xor, idx, up, down) write the lane's value to a per-warp buffer, wait for
    the warp, read the source lane's value and wait again (every lane of the warp must call
    them, as our kernels do with full masks; a diverged shuffle deadlocks: the timeout);
    __any_sync the same way, over the 32 lanes' predicates;
  * __shared__ arrays are function statics (one copy shared by the block's threads);
  * __half / __nv_bfloat16 are 16-bit structs converted exactly (g++'s _Float16; bfloat16 by
    its bits, float -> bfloat16 rounding to nearest even), so fp16/bf16 inputs and outputs run
    the kernels' own load and store paths;
  * __ldg, __funnelshift_l/r, __int_as_float and friends, rsqrtf, __popc, atomicAdd and atomicOr (a lock)
    as their definitions;
  * CUDA's launch limits (1024 threads per block, grid sizes) and its 48 KB of static shared
    memory per block (the kernel's statics, read from the program's symbol table) are checked;
  * outputs start filled with 0xff bytes (NaN for floats), as MLX hands a kernel uninitialized
    memory unless init_value is given: an element the kernel forgets to write shows.

What this checks: the kernel's own indexing, bit reads, warp reductions, barriers between
phases, online softmax, block merges, dtype conversions, as written, on the arguments its caller
builds. What it cannot check: nvrtc's acceptance of the source, CUDA-only semantics (memory
coalescing, register spills, divergence costs, speed), races between threads that the barrier
schedule happens to order (threads run concurrently here but not in lock step, so a missing
__syncwarp may go unnoticed), shared memory's initial garbage (statics start at zero and keep
the previous block's values), fast-math differences of CUDA's expf/fmaf (results agree to float
rounding, not bit for bit).

tests/cache/test_cuda_emulation.py checks the primitives themselves. The older interface of the
rotated kernel's test (compiled / run_partials / merge) is kept on
top of this (tests/cache/test_fused_decode_rotated.py).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from contextlib import contextmanager
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from veloxquant_mlx.cache.kernel_name import base_name

RUN_TIMEOUT_S = 120  # a deadlocked barrier (a shuffle not every lane calls) ends here
# VQ_CUDA_EMULATION_SANITIZE=1: AddressSanitizer and UBSan in the program (slower to build and
# run): a kernel reading or writing outside an input or output (each is its own allocation,
# without slack) or shifting by too much fails with the sanitizer's report.
SANITIZE = os.environ.get("VQ_CUDA_EMULATION_SANITIZE", "0") == "1"
_BUILD_FLAGS = ["-std=c++20", "-O1", "-pthread", "-w"] + (
    ["-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all"] if SANITIZE else [])


def _cxx20_compiler() -> str | None:
    """g++ when it builds a C++20 program with std::barrier, threads and _Float16 (else None:
    the tests skip; a kernel source that fails to compile with a working compiler is a test
    failure)."""
    compiler = shutil.which("g++")
    if compiler is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        probe = Path(tmp) / "probe.cpp"
        probe.write_text("#include <barrier>\n#include <thread>\n"
                         "int main() { std::barrier<> b(1); b.arrive_and_wait(); _Float16 h = 1.5f; return h != 1.5f; }\n")
        done = subprocess.run([compiler, "-std=c++20", "-pthread", str(probe), "-o", str(Path(tmp) / "probe")],
                              capture_output=True)
    return compiler if done.returncode == 0 else None


COMPILER = _cxx20_compiler()

_SHIM = r"""
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <algorithm>
#include <barrier>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>
using std::min; using std::max;
#define __device__
#define __host__
#define __global__
#define __forceinline__ inline
#define __noinline__
#define __launch_bounds__(...)
#define __restrict__
#define __grid_constant__
#define __shared__ static
#define __align__(x) __attribute__((aligned(x)))
#define inf std::numeric_limits<float>::infinity()
struct dim3v { unsigned x, y, z; };
thread_local dim3v threadIdx;
thread_local int vq_tid;  // the thread's linear index in its block
dim3v blockIdx, gridDim, blockDim;
std::barrier<>* vq_block_bar;
std::vector<std::unique_ptr<std::barrier<>>> vq_warp_bar;
std::vector<std::array<uint64_t, 32>> vq_xbuf;
std::mutex vq_atomic_lock;
constexpr int warpSize = 32;

inline void __syncthreads() { vq_block_bar->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { vq_warp_bar[vq_tid / 32]->arrive_and_wait(); }
template <typename T> inline T vq_exchange(T x, int src) {
  static_assert(sizeof(T) <= 8, "shuffle of a value wider than 8 bytes");
  const int w = vq_tid / 32, l = vq_tid % 32;
  std::memcpy(&vq_xbuf[w][l], &x, sizeof(T));
  vq_warp_bar[w]->arrive_and_wait();
  T y;
  std::memcpy(&y, &vq_xbuf[w][src], sizeof(T));
  vq_warp_bar[w]->arrive_and_wait();
  return y;
}
template <typename T> inline T __shfl_xor_sync(unsigned, T x, int o, int width = 32) {
  const int l = vq_tid % 32;
  return vq_exchange(x, l ^ (o & (width - 1)));
}
template <typename T> inline T __shfl_sync(unsigned, T x, int src, int width = 32) {
  const int l = vq_tid % 32;
  return vq_exchange(x, (l / width) * width + (src & (width - 1)));
}
template <typename T> inline T __shfl_down_sync(unsigned, T x, unsigned d, int width = 32) {
  const int l = vq_tid % 32;
  return vq_exchange(x, (int)(l % width + d) < width ? l + (int)d : l);
}
template <typename T> inline T __shfl_up_sync(unsigned, T x, unsigned d, int width = 32) {
  const int l = vq_tid % 32;
  return vq_exchange(x, (l % width) >= (int)d ? l - (int)d : l);
}
// Whether the predicate holds in any lane of the warp (every lane of the warp calls it).
inline bool __any_sync(unsigned, bool p) {
  const int w = vq_tid / 32, l = vq_tid % 32;
  vq_xbuf[w][l] = p ? 1u : 0u;
  vq_warp_bar[w]->arrive_and_wait();
  bool any = false;
  for (int i = 0; i < 32; ++i) any |= vq_xbuf[w][i] != 0u;
  vq_warp_bar[w]->arrive_and_wait();
  return any;
}
// CUDA's vector types the kernels load whole (vector_types.h; 16 / 8-byte aligned there too).
struct __align__(16) uint4 { unsigned int x, y, z, w; };
struct __align__(8) uint2 { unsigned int x, y; };
inline uint2 make_uint2(unsigned int x, unsigned int y) { return uint2{x, y}; }
template <typename T> inline T __ldg(const T* p) { return *p; }
template <typename T> inline T __ldcg(const T* p) { return *p; }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned s) {
  return (unsigned)((((unsigned long long)hi << 32) | lo) >> (s & 31));
}
inline unsigned __funnelshift_l(unsigned lo, unsigned hi, unsigned s) {
  return (unsigned)(((((unsigned long long)hi << 32) | lo) << (s & 31)) >> 32);
}
inline float __int_as_float(int x) { float f; std::memcpy(&f, &x, 4); return f; }
inline float __uint_as_float(unsigned x) { float f; std::memcpy(&f, &x, 4); return f; }
inline int __float_as_int(float x) { int i; std::memcpy(&i, &x, 4); return i; }
inline unsigned __float_as_uint(float x) { unsigned i; std::memcpy(&i, &x, 4); return i; }
inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }
inline float __expf(float x) { return expf(x); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
template <typename T> inline T atomicAdd(T* p, T v) {
  std::lock_guard<std::mutex> hold(vq_atomic_lock);
  const T old = *p;
  *p = old + v;
  return old;
}
template <typename T> inline T atomicOr(T* p, T v) {
  std::lock_guard<std::mutex> hold(vq_atomic_lock);
  const T old = *p;
  *p = old | v;
  return old;
}
// 16-bit floats, converted exactly (CUDA's __half2float etc. are exact too; float -> half and
// float -> bfloat16 round to nearest even, as CUDA's __float2half / __float2bfloat16).
struct __half {
  uint16_t x;
  operator float() const { _Float16 f; std::memcpy(&f, &x, 2); return (float)f; }
};
struct __nv_bfloat16 {
  uint16_t x;
  operator float() const { const uint32_t u = (uint32_t)x << 16; float f; std::memcpy(&f, &u, 4); return f; }
};
inline float __half2float(__half h) { return (float)h; }
inline float __bfloat162float(__nv_bfloat16 b) { return (float)b; }
inline __half __float2half(float x) { const _Float16 f = (_Float16)x; __half h; std::memcpy(&h.x, &f, 2); return h; }
inline __nv_bfloat16 __float2bfloat16(float x) {
  uint32_t u; std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return __nv_bfloat16{(uint16_t)((u >> 16) | 0x40u)};  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return __nv_bfloat16{(uint16_t)(u >> 16)};
}
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const uint64_t xy = ((uint64_t)y << 32) | x;
  unsigned r = 0;
  for (int i = 0; i < 4; ++i) r |= (unsigned)((xy >> (8 * ((s >> (4 * i)) & 7))) & 0xffu) << (8 * i);
  return r;
}
// The warp's mma.sync.m16n8k16 (fp16 or bf16 A, B; float32 C) as PTX lays out its fragments (see
// fused_decode's vq_mma_f16): every lane leaves its registers, the warp meets, each lane
// computes its four C entries from the whole A and B (products of fp16 exact in float32,
// summed in k order: the GPU's order and rounding of the sum may differ in the last bits).
#define VQ_EMULATED_MMA 1
std::vector<std::array<uint32_t, 32 * 6>> vq_mma_buf;
inline float vq_half_bits_f32(uint32_t h) { __half x; x.x = (uint16_t)h; return (float)x; }
inline float vq_bf16_bits_f32(uint32_t h) { __nv_bfloat16 x; x.x = (uint16_t)h; return (float)x; }
template <float (*F)(uint32_t)>
inline void vq_mma_emulated(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  const int w = vq_tid / 32, l = vq_tid % 32;
  uint32_t* mine = vq_mma_buf[w].data() + 6 * l;
  for (int i = 0; i < 4; ++i) mine[i] = a[i];
  mine[4] = b0;
  mine[5] = b1;
  vq_warp_bar[w]->arrive_and_wait();
  const uint32_t* all = vq_mma_buf[w].data();
  // A[row][k]: lane 4 (row % 8) + (k % 8) / 2, register (row / 8) + 2 (k / 8), half k % 2.
  const auto A = [all](int row, int k) {
    return F(all[6 * (4 * (row % 8) + (k % 8) / 2) + row / 8 + 2 * (k / 8)] >> (16 * (k % 2)));
  };
  // B[k][col]: lane 4 col + (k % 8) / 2, register 4 + k / 8, half k % 2.
  const auto B = [all](int k, int col) {
    return F(all[6 * (4 * col + (k % 8) / 2) + 4 + k / 8] >> (16 * (k % 2)));
  };
  const int g = l / 4, t = l % 4;
  float out[4];
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i / 2), col = 2 * t + i % 2;
    float sum = c[i];
    for (int k = 0; k < 16; ++k) sum += A(row, k) * B(k, col);
    out[i] = sum;
  }
  vq_warp_bar[w]->arrive_and_wait();
  for (int i = 0; i < 4; ++i) c[i] = out[i];
}
inline void vq_mma_f16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  vq_mma_emulated<vq_half_bits_f32>(c, a, b0, b1);
}
// The bf16 mma (fused_decode's vq_mma_bf16): the same fragments, bf16 halves.
inline void vq_mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  vq_mma_emulated<vq_bf16_bits_f32>(c, a, b0, b1);
}
"""

_MAIN = r"""
static std::vector<char> vq_read(const char* dir, const char* name) {
  char path[4096];
  std::snprintf(path, sizeof path, "%s/%s", dir, name);
  FILE* f = std::fopen(path, "rb");
  if (!f) { std::fprintf(stderr, "cannot open %s\n", path); std::exit(2); }
  std::fseek(f, 0, SEEK_END);
  const long n = std::ftell(f);
  std::fseek(f, 0, SEEK_SET);
  std::vector<char> data(n > 0 ? n : 1);  // no slack: a sanitized build sees any read past the end
  if (n && std::fread(data.data(), 1, n, f) != (size_t)n) { std::fprintf(stderr, "short read %s\n", path); std::exit(2); }
  std::fclose(f);
  return data;
}

int main(int argc, char** argv) {
  const char* dir = argv[1];
  FILE* spec = std::fopen((std::string(dir) + "/spec.txt").c_str(), "r");
  unsigned g[3], t[3];
  if (!spec || std::fscanf(spec, "%u %u %u %u %u %u", g, g + 1, g + 2, t, t + 1, t + 2) != 6) return 2;
  // Per input: ndim, shape, strides (elements).
  std::vector<std::vector<int32_t>> shapes(N_IN);
  std::vector<std::vector<int64_t>> strides(N_IN);
  std::vector<int> ndims(N_IN);
  for (int i = 0; i < N_IN; ++i) {
    if (std::fscanf(spec, "%d", &ndims[i]) != 1) return 2;
    shapes[i].resize(ndims[i] + 1); strides[i].resize(ndims[i] + 1);
    for (int d = 0; d < ndims[i]; ++d) if (std::fscanf(spec, "%d", &shapes[i][d]) != 1) return 2;
    for (int d = 0; d < ndims[i]; ++d) if (std::fscanf(spec, "%ld", &strides[i][d]) != 1) return 2;
  }
  std::fclose(spec);
  std::vector<std::vector<char>> in(N_IN), out(N_OUT);
  for (int i = 0; i < N_IN; ++i) in[i] = vq_read(dir, ("in" + std::to_string(i) + ".bin").c_str());
  for (int i = 0; i < N_OUT; ++i) out[i] = vq_read(dir, ("out" + std::to_string(i) + ".bin").c_str());

  gridDim = {(g[0] + t[0] - 1) / t[0], (g[1] + t[1] - 1) / t[1], (g[2] + t[2] - 1) / t[2]};
  blockDim = {t[0], t[1], t[2]};
  const int T = t[0] * t[1] * t[2];
  std::barrier<> block(T);
  vq_block_bar = &block;
  for (int w = 0; w * 32 < T; ++w) vq_warp_bar.push_back(std::make_unique<std::barrier<>>(std::min(32, T - 32 * w)));
  vq_xbuf.resize(vq_warp_bar.size());
  vq_mma_buf.resize(vq_warp_bar.size());
  for (unsigned bz = 0; bz < gridDim.z; ++bz) for (unsigned by = 0; by < gridDim.y; ++by)
  for (unsigned bx = 0; bx < gridDim.x; ++bx) {
    blockIdx = {bx, by, bz};
    std::vector<std::thread> threads;
    threads.reserve(T);
    for (int k = 0; k < T; ++k) threads.emplace_back([&, k] {
      vq_tid = k;
      threadIdx = {(unsigned)(k % t[0]), (unsigned)(k / t[0] % t[1]), (unsigned)(k / (t[0] * t[1]))};
      vq_kernel(CALL_ARGS);
    });
    for (auto& th : threads) th.join();
  }
  for (int i = 0; i < N_OUT; ++i) {
    const std::string path = std::string(dir) + "/out" + std::to_string(i) + ".bin";
    const size_t n = std::filesystem::file_size(path);  // before fopen truncates it
    FILE* f = std::fopen(path.c_str(), "wb");
    if (!f || std::fwrite(out[i].data(), 1, n, f) != n) return 3;
    std::fclose(f);
  }
  return 0;
}
"""

# MLX's dtype -> the CUDA type its generated kernel declares (dtype_to_cuda_type).
_C_TYPES = {
    mx.float32: "float", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16",
    mx.uint32: "uint32_t", mx.int32: "int32_t", mx.uint8: "uint8_t", mx.int8: "int8_t",
    mx.uint16: "uint16_t", mx.int16: "int16_t", mx.uint64: "uint64_t", mx.int64: "int64_t",
    mx.bool_: "bool",
}


class EmulationError(RuntimeError):
    """The emulated kernel did not compile, crashed, hung or was called wrongly."""


def _c_type(dtype) -> str:
    if dtype not in _C_TYPES:
        raise EmulationError(f"dtype {dtype} has no emulated CUDA type; allowed: {sorted(map(str, _C_TYPES))}")
    return _C_TYPES[dtype]


def _strip_cuda_includes(header: str) -> str:
    # cuda_fp16.h / cuda_bf16.h and MLX's device headers: the shim defines what they give.
    return re.sub(r'^\s*#include\s*[<"](cuda|mlx/|cooperative_groups)[^>"]*[>"]\s*$', "", header, flags=re.M)


@dataclass(frozen=True)
class _Signature:
    """What a generated kernel program depends on beyond the source: the template values and
    the dtype and rank of every input and output (MLX compiles one kernel per such set too)."""
    template: tuple[tuple[str, object], ...]
    input_dtypes: tuple
    input_ndims: tuple[int, ...]
    output_dtypes: tuple


class EmulatedKernel:
    """A kernel as mx.fast.cuda_kernel makes it, run by the thread-level emulation."""

    def __init__(self, name: str, input_names, output_names, source: str, header: str = "",
                 ensure_row_contiguous: bool = True, atomic_outputs: bool = False):
        if not output_names:
            raise EmulationError(f"cuda_kernel {name!r}: at least one output is needed")
        if atomic_outputs:
            raise EmulationError(f"cuda_kernel {name!r}: atomic_outputs is not emulated")
        # Named as our code writes it: the source digest that keys MLX's module cache
        # (kernel_name.build_kernel) is no part of what a test asserts about.
        self.name, self.source, self.header = base_name(name), source, header
        self.input_names, self.output_names = list(input_names), list(output_names)
        self.ensure_row_contiguous = ensure_row_contiguous
        self.calls = 0  # how often the kernel ran (a test checks that its path was taken)

    def _parameters(self, sig: _Signature) -> tuple[list[str], list[str]]:
        """The kernel's parameters as MLX generates them, and main()'s arguments for them."""
        params, args = [], []
        for i, (n, dtype, ndim) in enumerate(zip(self.input_names, sig.input_dtypes, sig.input_ndims)):
            params.append(f"const {_c_type(dtype)}* {n}")
            args.append(f"(const {_c_type(dtype)}*)in[{i}].data()")
            if ndim > 0 and f"{n}_shape" in self.source:
                params.append(f"const int32_t* {n}_shape")
                args.append(f"shapes[{i}].data()")
            if ndim > 0 and f"{n}_strides" in self.source:
                params.append(f"const int64_t* {n}_strides")
                args.append(f"strides[{i}].data()")
            if ndim > 0 and f"{n}_ndim" in self.source:
                params.append(f"const int {n}_ndim")
                args.append(f"ndims[{i}]")
        for i, (n, dtype) in enumerate(zip(self.output_names, sig.output_dtypes)):
            params.append(f"{_c_type(dtype)}* {n}")
            args.append(f"({_c_type(dtype)}*)out[{i}].data()")
        return params, args

    def _body(self, sig: _Signature) -> str:
        """The template constants, then the source: the kernel function's body."""
        constants = []
        for key, value in sig.template:
            if isinstance(value, bool):
                constants.append(f"  constexpr bool {key} = {'true' if value else 'false'};")
            elif isinstance(value, (int, np.integer)):
                constants.append(f"  constexpr int {key} = {int(value)};")
            elif isinstance(value, mx.Dtype):
                constants.append(f"  using {key} = {_c_type(value)};")
            else:
                raise EmulationError(f"cuda_kernel {self.name!r}: template argument {key}={value!r}; "
                                     "allowed are int, bool and an MLX dtype")
        return "\n".join(constants) + "\n" + self.source + "\n"

    def program(self, sig: _Signature) -> str:
        """The C++ program for one signature: the kernel as MLX generates it, and a main()."""
        params, args = self._parameters(sig)
        kernel = "void vq_kernel(" + ", ".join(params) + ") {\n" + self._body(sig) + "}\n"
        main = (_MAIN.replace("N_IN", str(len(self.input_names))).replace("N_OUT", str(len(self.output_names)))
                .replace("CALL_ARGS", ", ".join(args)))
        return _SHIM + _strip_cuda_includes(self.header) + "\n" + kernel + main

    def cuda_source(self, sig: _Signature) -> str:
        """The same kernel as a CUDA translation unit (real CUDA headers, `__global__`), for
        nvcc: tests/cache/test_kernels_nvcc.py compiles it for the H200 as a proxy for nvrtc."""
        params, _ = self._parameters(sig)
        return ("#include <cstdint>\n#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n" + self.header
                + f'\nextern "C" __global__ void {self.name}(' + ", ".join(params) + ") {\n"
                + self._body(sig) + "}\n")

    def executable(self, sig: _Signature) -> Path:
        return _build(self.program(sig))

    def __call__(self, *, inputs, output_shapes, output_dtypes, grid, threadgroup, template=None,
                 init_value=None, verbose=False, stream=None):
        if len(inputs) != len(self.input_names):
            raise EmulationError(f"cuda_kernel {self.name!r}: {len(inputs)} inputs for names {self.input_names}")
        if len(output_shapes) != len(self.output_names) or len(output_dtypes) != len(self.output_names):
            raise EmulationError(f"cuda_kernel {self.name!r}: {len(output_shapes)} output shapes and "
                                 f"{len(output_dtypes)} dtypes for outputs {self.output_names}")
        arrays = [x if isinstance(x, mx.array) else mx.array(x) for x in inputs]
        if self.ensure_row_contiguous:
            arrays = [mx.contiguous(a) for a in arrays]
        mx.eval(*arrays)
        sig = _Signature(tuple((k, v) for k, v in (template or [])), tuple(a.dtype for a in arrays),
                         tuple(a.ndim for a in arrays), tuple(output_dtypes))
        if _CAPTURED is not None:  # signatures_only(): record, run nothing
            _CAPTURED.append((self, sig))
            return [_from_bytes(_initial_output(shape, dtype, init_value), shape, dtype)
                    for shape, dtype in zip(output_shapes, output_dtypes)]
        _check_launch(self.name, grid, threadgroup)
        exe = self.executable(sig)
        if verbose:
            print(self.program(sig))
        shared = _static_shared_bytes(exe)
        if shared is not None and shared > SHARED_LIMIT:
            raise EmulationError(f"emulated kernel {self.name!r} declares {shared} bytes of __shared__ memory; "
                                 f"CUDA allows {SHARED_LIMIT} static bytes per block")
        with tempfile.TemporaryDirectory(prefix="vq_cuda_run_") as tmp:
            run_dir = Path(tmp)
            spec = [" ".join(map(str, (*grid, *threadgroup)))]
            for i, a in enumerate(arrays):
                host = _to_numpy(a)
                strides = [s // host.itemsize for s in host.strides]
                spec.append(" ".join(map(str, (a.ndim, *a.shape, *strides))))
                (run_dir / f"in{i}.bin").write_bytes(host.tobytes())
            (run_dir / "spec.txt").write_text("\n".join(spec) + "\n")
            for i, (shape, dtype) in enumerate(zip(output_shapes, output_dtypes)):
                (run_dir / f"out{i}.bin").write_bytes(_initial_output(shape, dtype, init_value))
            try:
                done = subprocess.run([str(exe), str(run_dir)], capture_output=True, timeout=RUN_TIMEOUT_S)
            except subprocess.TimeoutExpired as exc:
                raise EmulationError(f"emulated kernel {self.name!r} ran past {RUN_TIMEOUT_S} s (a deadlock: "
                                     "a barrier or shuffle not every thread reached?)") from exc
            if done.returncode != 0:
                raise EmulationError(f"emulated kernel {self.name!r} failed with exit status {done.returncode}: "
                                     + _report(done.stderr.decode(errors="replace")))
            outs = [_from_bytes((run_dir / f"out{i}.bin").read_bytes(), shape, dtype)
                    for i, (shape, dtype) in enumerate(zip(output_shapes, output_dtypes))]
        self.calls += 1
        return outs


SHARED_LIMIT = 48 * 1024  # static __shared__ bytes per block (more needs opt-in dynamic memory)


def _check_launch(name: str, grid, threadgroup) -> None:
    """The launch limits CUDA enforces (a launch beyond them fails on the GPU)."""
    where = f"emulated kernel {name!r}"
    if len(grid) != 3 or len(threadgroup) != 3 or min(*grid, *threadgroup) < 1:
        raise EmulationError(f"{where}: grid {grid} and threadgroup {threadgroup} must be 3 positive ints")
    if int(np.prod(threadgroup)) > 1024 or threadgroup[2] > 64:
        raise EmulationError(f"{where}: threadgroup {threadgroup} exceeds CUDA's 1024 threads per block (z <= 64)")
    blocks = [-(-g // t) for g, t in zip(grid, threadgroup)]
    if blocks[0] >= 2**31 or blocks[1] > 65535 or blocks[2] > 65535:
        raise EmulationError(f"{where}: {blocks} blocks exceed CUDA's grid limits (2^31-1, 65535, 65535)")


_SHARED_BYTES: dict[Path, int | None] = {}


def _static_shared_bytes(exe: Path) -> int | None:
    """Bytes of the kernel function's __shared__ arrays (its local statics, from the symbol table),
    None without nm. Shared arrays declared in helper functions are not counted."""
    if exe not in _SHARED_BYTES:
        nm = shutil.which("nm")
        total = None
        if nm:
            listing = subprocess.run([nm, "-S", str(exe)], capture_output=True, text=True).stdout
            total = sum(int(f[1], 16) for f in (line.split() for line in listing.splitlines())
                        if len(f) == 4 and f[3].startswith("_ZZ9vq_kernel"))
        _SHARED_BYTES[exe] = total
    return _SHARED_BYTES[exe]


def _report(stderr: str) -> str:
    """The start of a sanitizer's report (what was read where), else the end of stderr."""
    for mark in ("ERROR: AddressSanitizer", "runtime error"):
        at = stderr.find(mark)
        if at >= 0:
            return stderr[max(0, at - 200): at + 2500]
    return stderr[-2500:]


_CAPTURED: list | None = None


@contextmanager
def signatures_only():
    """Within: emulated kernels record (kernel, signature) instead of running and return poisoned
    outputs; the list is yielded. A test collects what its cases will compile from small caches
    and builds it at once with prebuild_captured (the signature does not depend on the number of
    tokens, only on dtypes, ranks and template values)."""
    global _CAPTURED
    _CAPTURED = captured = []
    try:
        yield captured
    finally:
        _CAPTURED = None


def prebuild_captured(captured) -> None:
    """Compile the captured programs, one per core."""
    programs = {k.program(sig) for k, sig in captured}
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        list(pool.map(_build, programs))


def cuda_kernel(name, input_names, output_names, source, header="", ensure_row_contiguous=True,
                atomic_outputs=False) -> EmulatedKernel:
    """A drop-in for mx.fast.cuda_kernel whose kernels run on the CPU by the emulation."""
    return EmulatedKernel(name, input_names, output_names, source, header, ensure_row_contiguous, atomic_outputs)


def _to_numpy(a: mx.array) -> np.ndarray:
    if a.dtype == mx.bfloat16:  # numpy has no bfloat16: its bits
        a = a.view(mx.uint16)
    return np.ascontiguousarray(np.array(a))


def _numpy_dtype(dtype) -> np.dtype:
    if dtype == mx.bfloat16:
        return np.dtype(np.uint16)
    return np.array(mx.zeros((1,), dtype=dtype)).dtype


def _initial_output(shape, dtype, init_value) -> bytes:
    n = int(np.prod(shape, dtype=np.int64))
    if init_value is None:  # uninitialized memory, poisoned: NaN for floats
        return b"\xff" * (n * _numpy_dtype(dtype).itemsize)
    return _to_numpy(mx.full(tuple(shape), init_value, dtype=dtype)).tobytes()


def _from_bytes(data: bytes, shape, dtype) -> mx.array:
    host = np.frombuffer(data, dtype=_numpy_dtype(dtype)).reshape(shape).copy()
    out = mx.array(host)
    return out.view(mx.bfloat16) if dtype == mx.bfloat16 else out


def _cache_dir() -> Path:
    path = Path(tempfile.gettempdir()) / f"vq_cuda_emulation_{os.getuid()}"
    path.mkdir(exist_ok=True)
    return path


_PCH_LOCK = threading.Lock()


def _shim_header() -> Path:
    """The shim as a header with its precompiled form beside it (built once, on disk): the
    standard headers it includes are most of a program's compile time (~0.5 s of ~1.1 s).
    g++ falls back to the text where the .gch does not fit, so this only saves time."""
    key = hashlib.sha256((_SHIM + " ".join(_BUILD_FLAGS) + COMPILER).encode()).hexdigest()[:24]
    header = _cache_dir() / f"shim_{key}.h"
    with _PCH_LOCK:
        if not Path(str(header) + ".gch").exists():
            with tempfile.TemporaryDirectory(prefix="vq_cuda_build_", dir=_cache_dir()) as tmp:
                text, pch = Path(tmp) / header.name, Path(tmp) / (header.name + ".gch")
                text.write_text(_SHIM)
                done = subprocess.run([COMPILER, *_BUILD_FLAGS, "-x", "c++-header", str(text), "-o", str(pch)],
                                      capture_output=True)
                if done.returncode != 0:
                    raise EmulationError("the emulation's shim does not compile:\n"
                                         + done.stderr.decode(errors="replace")[-4000:])
                os.replace(text, header)  # the text first: a .gch is only looked for beside it
                os.replace(pch, Path(str(header) + ".gch"))
    return header


def _build(program: str) -> Path:
    """The compiled program (cached on disk by the hash of its text and the compiler flags)."""
    if COMPILER is None:
        raise EmulationError("no g++ with C++20 std::barrier: the emulation cannot run")
    assert program.startswith(_SHIM)
    key = hashlib.sha256((program + " ".join(_BUILD_FLAGS) + COMPILER).encode()).hexdigest()[:24]
    exe = _cache_dir() / f"kernel_{key}"
    if exe.exists():
        return exe
    header = _shim_header()
    with tempfile.TemporaryDirectory(prefix="vq_cuda_build_") as tmp:
        src = Path(tmp) / "kernel.cpp"
        src.write_text(program[len(_SHIM):])  # the shim comes in by -include, precompiled
        done = subprocess.run([COMPILER, *_BUILD_FLAGS, "-include", str(header), str(src),
                               "-o", str(Path(tmp) / "kernel")], capture_output=True)
        if done.returncode != 0:
            raise EmulationError("the kernel source does not compile under the emulation:\n"
                                 + done.stderr.decode(errors="replace")[-4000:])
        os.replace(Path(tmp) / "kernel", exe)  # atomic: concurrent builders leave one whole file
    return exe


# ---- the interface of the rotated kernel's test (test_fused_decode_rotated.py) ----

NAMES = ["q", "ksg", "vsg", "kmean", "kc1", "ks1", "kz1", "kc2", "km2",
         "vc1", "vs1", "vz1", "vc2", "vm2", "wk", "wv", "sk", "sv"]
CODE_INPUTS = {"kc1", "kc2", "vc1", "vc2"}
_ROTATED_TEMPLATE = ("D", "DV", "R", "KB1", "VB1", "KG", "VG")


def _rotated_kernel() -> EmulatedKernel:
    from veloxquant_mlx.cache import fused_decode_rotated as fdr

    assert NAMES + ["meta", "wn"] == fdr._INPUTS
    return cuda_kernel("vq_rotated_decode_partials", fdr._INPUTS, ["part_o", "part_m", "part_l"],
                       fdr._PARTIALS, fdr._HEADER)


def _rotated_signature(cfg, ndims) -> _Signature:
    template = tuple(zip(_ROTATED_TEMPLATE, cfg)) + (("QT", mx.float32), ("WB", 0))  # wn: all of wk
    dtypes = tuple(mx.uint32 if n in CODE_INPUTS else mx.float32 for n in NAMES) + (mx.int32, mx.uint8)
    return _Signature(template, dtypes, tuple(ndims), (mx.float32,) * 3)


def compiled(configs: tuple[tuple[int, ...], ...]):
    """The rotated partials kernel for template configs (D, DV, R, KB1, VB1, KG, VG), float32
    inputs, compiled (in parallel) before the runs; the handle run_partials takes."""
    kernel = _rotated_kernel()
    # Ranks as decode_step hands them: q (B, Hq, 1, D) ... the sink's dummies; only the inputs
    # whose *_shape the source reads (wk, kc2) need a rank > 0 to be declared.
    ndims = (4,) * len(NAMES) + (1, 1)
    prebuild_captured([(kernel, _rotated_signature(c, ndims)) for c in configs])
    return kernel


def run_partials(lib, cfg, arrays: list[np.ndarray], meta: np.ndarray, wk_shape, kc2_shape,
                 n_blocks: int, BH: int, R: int, DV: int):
    """(part_o, part_m, part_l) of the emulated rotated partials kernel for the inputs in NAMES
    order (float32; codes uint32), as numpy arrays."""
    arrays = [np.ascontiguousarray(a, dtype=np.uint32 if n in CODE_INPUTS else np.float32)
              for n, a in zip(NAMES, arrays)]
    # wn: the window's rows as a length (fused_decode.window_rows): here the whole wk.
    inputs = [mx.array(a) for a in arrays] + [mx.array(np.asarray(meta, dtype=np.int32)),
                                              mx.zeros((wk_shape[2],), dtype=mx.uint8)]
    # The kernel reads only wk_shape and kc2_shape; they must be the arrays' own shapes.
    assert tuple(inputs[NAMES.index("wk")].shape) == tuple(wk_shape)
    assert tuple(inputs[NAMES.index("kc2")].shape) == tuple(kc2_shape)
    sig = _rotated_signature(cfg, [a.ndim for a in inputs])
    outs = lib(inputs=inputs, template=[*sig.template], grid=(128 * n_blocks, BH, 1), threadgroup=(128, 1, 1),
               output_shapes=[(BH, n_blocks, R, DV), (BH, n_blocks, R), (BH, n_blocks, R)],
               output_dtypes=[mx.float32] * 3)
    return tuple(np.array(o) for o in outs)


def merge(part_o, part_m, part_l) -> np.ndarray:
    """fused_decode's merge kernel in numpy: (BH, R, DV)."""
    top = part_m.max(axis=1, keepdims=True)
    w = np.where(np.isneginf(part_m), 0.0, np.exp(part_m - top))
    return (w[..., None] * part_o).sum(1) / (w * part_l).sum(1)[..., None]


def kernel_builders() -> list:
    """The lru-cached kernel factories of every veloxquant_mlx.cache.fused_* / *_kernel module (each
    builds its mx.fast.cuda_kernel objects once): emptied, they build anew with whatever
    mx.fast.cuda_kernel is at the time (step_census's list, which empties them the same way)."""
    from veloxquant_mlx.bench.step_census import kernel_factories

    return kernel_factories()


@contextmanager
def emulated_kernels(enabled=None):
    """Within: our caches' CUDA kernels are on (fused_decode.kernels_enabled; `enabled`: what
    decides instead, e.g. the VELOXQUANT_CUDA_KERNELS switch alone, as on CUDA) and built by this
    emulation (the module's `cuda_kernel`, looked up at build time so a test may wrap it); the
    kernel factories are emptied before and after, so no emulated kernel outlives the block.
    Yields the list of kernels built inside (a test checks which ran)."""
    from veloxquant_mlx.cache import compiled_launch, fused_decode

    made = []

    def build(*args, **kwargs):
        made.append(cuda_kernel(*args, **kwargs))
        return made[-1]

    builders = kernel_builders()
    saved = mx.fast.cuda_kernel, fused_decode.kernels_enabled, compiled_launch.compile_function
    for built in builders:
        built.cache_clear()
    # The emulation runs eagerly through numpy and cannot be traced: a compiled launch (as
    # shipped on CUDA) calls its function as it is, the counted build and all.
    mx.fast.cuda_kernel, fused_decode.kernels_enabled = build, (enabled or (lambda: True))
    compiled_launch.compile_function = lambda function: function
    try:
        yield made
    finally:
        mx.fast.cuda_kernel, fused_decode.kernels_enabled, compiled_launch.compile_function = saved
        for built in builders:
            built.cache_clear()


def emulated_decode_step(cache, q_heads, scale):
    """`cache.attention` for one decode step with the kernels on and emulated -> (output
    evaluated, the kernels built)."""
    with emulated_kernels() as made:
        out = cache.attention(q_heads, scale=scale)
        mx.eval(out)
    return out, made


def planned_step_and_template(monkeypatch, cache, q_heads, scale):
    """One emulated decode step of `cache` planned afresh (its launch plan keeps the template it
    was built with: a test that changes a switch between steps needs a new one) -> (output as
    a float32 numpy array, the one partials launch's template as a dict)."""
    cache.__dict__.pop("_fused_plan", None)
    templates = []
    real = EmulatedKernel.__call__
    monkeypatch.setattr(EmulatedKernel, "__call__",
                        lambda self, **k: templates.append(dict(k["template"])) or real(self, **k))
    try:
        got, made = emulated_decode_step(cache, q_heads, scale)
    finally:
        monkeypatch.setattr(EmulatedKernel, "__call__", real)
    assert [k.calls for k in made if k.calls] == [1], "the decode step did not run its kernel"
    return np.array(got.astype(mx.float32)), templates[0]
