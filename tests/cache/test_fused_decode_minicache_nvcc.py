"""fused_decode_merged's partials kernel compiled by nvcc for the H200 (sm_90), where nvcc is
installed (no GPU needed): what the CPU emulation cannot check, whether CUDA's front end accepts
the source and what ptxas makes of it (registers, spills).

The kernel is wrapped as mx.fast.cuda_kernel wraps a source (tests/cache/cuda_emulation.py
describes MLX's generation): one `const T*` per input, `name_shape` where the source reads it,
the template constants, then the source. MLX's own header (which defines uint32_t for its
generated parameters) is stood in for by <cstdint>. nvcc is not nvrtc (MLX compiles with
nvrtc): same front end and ptxas, but nvrtc has no host headers, so a source that only
compiles thanks to one would pass here; the kernel includes nothing beyond cuda_fp16.h /
cuda_bf16.h.
"""

import re
import shutil
import subprocess

import pytest

from veloxquant_mlx.cache import fused_decode_merged, partials_merge_source

NVCC = shutil.which("nvcc")
pytestmark = pytest.mark.skipif(NVCC is None, reason="needs nvcc (CUDA toolkit) to compile the kernel for sm_90")

_C_TYPES = {"f32": "float", "f16": "__half", "bf16": "__nv_bfloat16", "u32": "uint32_t", "i32": "int32_t", "u8": "uint8_t"}


def _program(D, DV, R, S, DB, QT, RT, PV=1, fused=False) -> str:
    DT = "u32" if DB else "f16"
    dtypes = dict(q=QT, dk=DT, dv=DT, dks="f16", dkb="f16", dvs="f16", dvb="f16", mk="f16", mv="f16",
                  rk=RT, rv=RT, pk="i32", pv="i32", wk=QT, wv=QT, meta="i32", wn="u8")
    source = fused_decode_merged._PARTIALS
    if fused:  # the merge fused in (fused_decode.MERGE_IN_KERNEL): outputs the attention
        source = partials_merge_source.FUSED_PROLOGUE + source + partials_merge_source.FUSED_EPILOGUE
    params = []
    for name in fused_decode_merged._INPUTS:
        params.append(f"const {_C_TYPES[dtypes[name]]}* {name}")
        if f"{name}_shape" in source:
            params.append(f"const int32_t* {name}_shape")
    if fused:  # the counters, the partials' scratch and the launch to follow (FusedLaunchState), then the output
        params += ["const int32_t* counts", "const float* scratch", f"const {_C_TYPES[QT]}* after", f"{_C_TYPES[QT]}* out"]
    else:
        params += ["float* part_o", "float* part_m", "float* part_l"]
    template = dict(D=D, DV=DV, R=R, PV=PV, S=S, DB=DB, QT=QT, DT=DT, ST="f16", MT="f16", RT=RT, WB=0)
    constants = [f"  using {k} = {_C_TYPES[v]};" if isinstance(v, str) else f"  constexpr int {k} = {v};"
                 for k, v in template.items()]
    return ("#include <cstdint>\n" + fused_decode_merged._HEADER
            + '\nextern "C" __global__ void vq_merged_decode_partials(' + ", ".join(params) + ") {\n"
            + "\n".join(constants) + "\n" + source + "\n}\n")


def _ptxas_report(tmp_path, label, **shape) -> tuple[int, int]:
    source = tmp_path / f"{label}.cu"
    source.write_text(_program(**shape))
    done = subprocess.run([NVCC, "-arch=sm_90", "-cubin", "-std=c++17", "-Xptxas", "-v", str(source),
                           "-o", str(tmp_path / f"{label}.cubin")], capture_output=True, text=True)
    report = done.stdout + done.stderr
    assert done.returncode == 0, report[-4000:]
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    spilled = int(re.search(r"(\d+) bytes spill stores", report).group(1))
    print(f"{label}: {registers} registers, {spilled} bytes spilled")
    return registers, spilled


# The default config on the 8B shape (bf16, head_dim 128, 4 rows per kv head, 4 slots), with
# fp16 directions (values prefetched or not) and with 4-bit directions: no spills (on
# 2026-11-30, nvcc 13.0: 222, 170 and 208 registers; fused_decode's kivi kernel: 184).
@pytest.mark.parametrize("fused", [False, True], ids=["split", "merge fused in"])
@pytest.mark.parametrize("DB, PV", [(0, 1), (0, 0), (4, 1)], ids=["fp16 directions", "fp16 no prefetch", "4-bit directions"])
def test_the_8b_shape_compiles_for_sm90_without_spills(tmp_path, DB, PV, fused):
    registers, spilled = _ptxas_report(tmp_path, f"db{DB}pv{PV}", D=128, DV=128, R=4, S=4, DB=DB, QT="bf16",
                                       RT="bf16", PV=PV, fused=fused)
    assert spilled == 0 and registers <= 255


# The corners supports() takes compile too; the widest ones spill (8 rows x 16 slots in float32,
# 256 dims at 8 rows): correct but slower, not the default.
@pytest.mark.slow
@pytest.mark.parametrize("shape", [
    dict(D=64, DV=64, R=1, S=0, DB=0, QT="f16", RT="f16"),
    dict(D=128, DV=128, R=8, S=16, DB=0, QT="f32", RT="f32"),
    dict(D=256, DV=256, R=8, S=16, DB=2, QT="bf16", RT="bf16"),
    dict(D=128, DV=64, R=2, S=1, DB=8, QT="f16", RT="f16"),
], ids=["hd64 mha fp16", "f32 r8 s16", "hd256 r8 2-bit", "dv64 8-bit"])
def test_the_supported_corners_compile_for_sm90(tmp_path, shape):
    _ptxas_report(tmp_path, "corner", **shape)
