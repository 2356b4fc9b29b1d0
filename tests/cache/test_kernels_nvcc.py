"""Every CUDA kernel our caches launch, compiled by nvcc for the H200 (sm_90) where the CUDA
toolkit is installed: a proxy for nvrtc's acceptance of the source (MLX compiles with nvrtc at
run time, on the GPU; only the CUDA tests there check that), and ptxas's report must show no
register spills. Each cache's real decode step runs with the kernels "on" and the CUDA
emulation recording the launches instead of running them (cuda_emulation.signatures_only), so
the sources compiled are those the caches build, with their template values and dtypes.

Slow (an nvcc run per kernel signature, ~10-30 s each on a loaded machine): not in the CI
subset, whose machines have no CUDA toolkit anyway."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import pytest

from tests.cache import cuda_emulation
from veloxquant_mlx.bench import gear_terms_probe
from veloxquant_mlx.cache.factory import KVCacheFactory
from veloxquant_mlx.config import KVCacheConfig

NVCC = shutil.which("nvcc")
pytestmark = [pytest.mark.slow, pytest.mark.skipif(NVCC is None, reason="needs nvcc (the CUDA toolkit)")]

# The 8B model's heads (GQA 4, head_dim 128) in bf16, the methods' defaults; fp16 with 8 rows
# and float32 with 1 row (other template values, other register budgets); SmolLM2's heads (3 rows
# of head_dim 64: kvquant's exact loops spilled there before they were unrolled by 4 only).
# turboquant_rvq's kernel kept 16 value channels per lane whatever the rows and spilled at 8 rows
# until it split a token over more lanes there; SPILLS lists any case known to spill.
SPILLS: dict = {}
SHAPES = ((mx.bfloat16, 4, 128), (mx.float16, 8, 128), (mx.float32, 1, 128), (mx.bfloat16, 3, 64))
CASES = [
    pytest.param(method, dtype, rep, D, marks=[pytest.mark.xfail(strict=True, reason=SPILLS[method, rep, D])]
                 if (method, rep, D) in SPILLS else [], id=f"{method}-{str(dtype).split('.')[-1]}-r{rep}-d{D}")
    for method in ("kivi", "xquant", "turboquant_rvq", "gear", "kvquant")  # minicache: its own nvcc test (pairs)
    for dtype, rep, D in SHAPES
]


def _captured(method: str, dtype, rep: int, D: int) -> list:
    """(kernel, signature) of every launch of one decode step of `method`'s cache."""
    cache = KVCacheFactory.create(KVCacheConfig(method=method), layer_index=0, n_layers=1)
    H = 2
    mx.random.seed(0)
    k = mx.random.normal((1, H, 700, D)).astype(dtype)
    cache.update_and_fetch(k, k)
    cache.attention(mx.random.normal((1, H * rep, 700, D)).astype(dtype), scale=D**-0.5)  # flush
    cache.update_and_fetch(k[:, :, :1], k[:, :, :1])
    with cuda_emulation.signatures_only() as captured, cuda_emulation.emulated_kernels():
        cache.attention(mx.random.normal((1, H * rep, 1, D)).astype(dtype), scale=D**-0.5)
    return list(captured)


def _compile(source: str, tmp_path, index: int) -> str:
    path = tmp_path / f"kernel{index}.cu"
    path.write_text(source)
    done = subprocess.run([NVCC, "-arch=sm_90", "-cubin", "-o", str(path.with_suffix(".cubin")),
                           "-Xptxas", "-v", str(path)], capture_output=True, text=True, timeout=600)
    report = done.stdout + done.stderr
    assert done.returncode == 0, f"nvcc failed:\n{report[-3000:]}"
    return report


def compiled_without_spills(source: str, tmp_path, index: int = 0) -> str:
    """ptxas's report of `source` compiled by nvcc for sm_90 (printed registers), asserting that
    nothing spilled."""
    report = _compile(source, tmp_path, index)
    print(re.findall(r"Used \d+ registers.*", report))
    assert re.search(r"\b0 bytes spill stores, 0 bytes spill loads", report), report
    return report


@pytest.mark.parametrize("method, dtype, rep, D", CASES)
def test_every_kernel_compiles_for_sm90_without_spills(tmp_path, method, dtype, rep, D):
    captured = _captured(method, dtype, rep, D)
    assert len(captured) >= 1, f"{method}: the decode step launched {len(captured)} kernels (kernels not taken?)"
    sources = sorted({kernel.cuda_source(sig) for kernel, sig in captured})
    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(lambda a: compiled_without_spills(a[1], tmp_path, a[0]), enumerate(sources)))


def test_turboquant_rvqs_bounded_kernel_fits_five_blocks_per_sm(tmp_path):
    # fused_decode_rotated.MIN_BLOCKS_PER_SM at the 8B shape: 108 registers unbounded (4 blocks
    # of 128 threads per SM), <= 96 bounded (5 blocks), without spilling.
    from veloxquant_mlx.cache import fused_decode_rotated

    captured = _captured("turboquant_rvq", mx.bfloat16, 4, 128)
    (source,) = {k.cuda_source(sig) for k, sig in captured if k.name == "vq_rotated_decode_partials_merged"}
    assert f"__launch_bounds__(128, {fused_decode_rotated.MIN_BLOCKS_PER_SM})" in source
    report = compiled_without_spills(source, tmp_path)
    registers = int(re.search(r"Used (\d+) registers", report)[1])
    assert registers <= 65536 // (fused_decode_rotated.MIN_BLOCKS_PER_SM * 128) // 8 * 8, report


# The affine kernel's switches that are off as shipped, each (constant, template name, whether
# a shape takes it): WINDOW_ROW_VECTORS (session 21, at the 8B shape kivi and xquant 125
# registers, gear 125 against 96 off) and MMA_SCORES (session 22: 16-bit queries, 2-bit keys,
# 1, 2 or 4 rows, whole-tile stages: the 8B shape; kivi 128 registers, gear 102) and
# MMA_VALUES (session 30: 16-bit side data, 2-bit values, up to 8 rows; the plain kernel only)
# and L2_PREFETCH (session 30: every shape).
SWITCHES = [
    ("WINDOW_ROW_VECTORS", "WRV", lambda method, dtype, rep, D: True),
    # GEAR's build keeps its FMA scores (fused_decode_gear.MMA_SCORES)
    ("MMA_SCORES", "MMA", lambda method, dtype, rep, D: method != "gear" and dtype != mx.float32 and rep in (1, 2, 4)
     and D % 16 == 0),
    ("MMA_VALUES", "MMAV", lambda method, dtype, rep, D: method != "gear" and dtype != mx.float32 and D % 16 == 0),
    ("L2_PREFETCH", "PF", lambda method, dtype, rep, D: True),
]


@pytest.mark.parametrize("constant, name, takes", SWITCHES, ids=[s[0] for s in SWITCHES])
@pytest.mark.parametrize("method, dtype, rep, D", [
    pytest.param(method, dtype, rep, D, id=f"{method}-{str(dtype).split('.')[-1]}-r{rep}-d{D}")
    for method in ("kivi", "xquant", "gear") for dtype, rep, D in SHAPES])
def test_the_switched_off_paths_compile_without_spills(tmp_path, monkeypatch, method, dtype, rep, D,
                                                       constant, name, takes):
    # Each switch on over the shapes above: the build takes it where the shape allows, compiles
    # and does not spill; -s prints its registers.
    from veloxquant_mlx.cache import fused_decode

    monkeypatch.setattr(fused_decode, constant, 1)
    captured = _captured(method, dtype, rep, D)
    sources = {k.cuda_source(sig) for k, sig in captured if "partials" in k.name}
    assert sources and all(f"constexpr int {name} = {int(takes(method, dtype, rep, D))};" in s for s in sources)
    for i, source in enumerate(sorted(sources)):
        compiled_without_spills(source, tmp_path, i)


def _inner_loops(sass: str) -> list[tuple[int, int]]:
    """(instructions, FFMA) of each innermost loop of cuobjdump's SASS (a backward branch's span
    holding no other), largest first."""
    ins = [(int(m[1], 16), m[2].split()) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    ops = [words[1] if words[0].startswith("@") else words[0] for _, words in ins]
    at = {address: i for i, (address, _) in enumerate(ins)}
    spans = []
    for i, (address, words) in enumerate(ins):
        target = re.search(r"0x([0-9a-f]+)", " ".join(words))
        if ops[i] == "BRA" and target and int(target[1], 16) in at and int(target[1], 16) <= address:
            spans.append((at[int(target[1], 16)], i))
    inner = [s for s in spans if not any(o != s and s[0] <= o[0] and o[1] <= s[1] for o in spans)]
    return sorted(((b - a + 1, sum(op.startswith("FFMA") for op in ops[a:b + 1])) for a, b in inner), reverse=True)


@pytest.mark.parametrize("variant", list(gear_terms_probe.VARIANTS))
def test_gear_terms_probes_variants_compile_without_spills(tmp_path, variant):
    # bench.gear_terms_probe's variants (GEAR's decode kernel with terms dropped from its
    # template) at the 8B shape: -s prints each build's registers and, where CUOBJDUMP names
    # cuobjdump, its instruction count and innermost loops (session 23: shipped 96 registers,
    # 8,496 instructions; without the three terms 128 and 5,680, the key and value loops the same).
    changes = gear_terms_probe.VARIANTS[variant]
    with gear_terms_probe.template_changes(changes):  # a new cache: its first step builds the plan
        captured = _captured("gear", mx.bfloat16, 4, 128)
    sources = {k.cuda_source(sig) for k, sig in captured if k.name == "vq_gear_decode_partials_merged"}
    assert len(sources) == 1 and all(f"constexpr int {k} = {v};" in s for s in sources for k, v in changes.items())
    compiled_without_spills(sources.pop(), tmp_path)
    cuobjdump = os.environ.get("CUOBJDUMP")
    if cuobjdump:
        sass = subprocess.run([cuobjdump, "-sass", str(tmp_path / "kernel0.cubin")], capture_output=True,
                              text=True, check=True).stdout
        print(variant, len(re.findall(r"/\*[0-9a-f]{4,}\*/\s+[^;]*;", sass)), "instructions,",
              len(re.findall(r"ATOMS\.CAST\.SPIN", sass)), "ATOMS.CAST.SPIN "
              "(shared-memory compare-and-swap); innermost loops (instructions, FFMA):", _inner_loops(sass)[:3])
