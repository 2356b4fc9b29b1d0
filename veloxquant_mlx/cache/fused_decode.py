"""Two CUDA kernels for a decode step over affine-quantized K/V (KIVI's layout), split over tokens.

Why: on MLX's CUDA backend a decode step over the compressed history ran as ~15 small ops per
layer (quantized_matmul for the scores, masking, softmax, a split quantized_matmul for the values,
the window, concatenations); on the H200 that made KIVI decode at 0.59x the fp16 cache's speed at
32K tokens although it reads 5x fewer bytes (results/gpu_speed_h200.json). These kernels read the
packed codes once: the first produces, per block of consecutive history tokens (and one block
for the exact tokens: an optional exact sink, then the window) and per query row, the
flash-decoding partials
  m = max score, l = sum exp(score - m), o = sum exp(score - m) * value,
and the second merges them into the output row (weights exp(m - max m)), in float32.

Layout read (the one KIVICache and XQuantCache store, MLX's mx.quantize stream):
  keys   K^T per channel: codes (B, H, D, capacity * KB / 32) uint32, a little-endian bit stream
         along tokens; scales/zeros (B, H, D, capacity / G): element = scale * code + zero;
  values per token: codes (B, H, capacity, DV * VB / 32), stream along channels;
         scales/zeros (B, H, capacity, DV / G).
Exact tokens: the window (B, H, W, D / DV) and a sink (B, H, S, D / DV, e.g. KIVI's first token,
whose codes in the history are a placeholder the kernel skips), both in the queries' dtype; the
sink is an input of its own (sk, sv), so a step with a sink launches the two kernels and no copy.
Blocks of 4 warps per (batch*kv-head, range of tokens); GQA query rows share the codes they read;
each warp copies its tile's history (codes, scales, zeros of keys, then of values) into a stage in
shared memory, all its loads issued before the first store (vq_stage), and computes from there
(with 16-bit queries and 2-bit codes both products on tensor cores: MMA_SCORES, MMA_VALUES);
the work split, the inputs and the shared-memory layout are described with the kernel's text
(affine_partials_source.py), the header it shares with every kernel of ours in kernel_header.py,
the merge in partials_merge_source.py. GEARCache's store is this layout plus a low-rank and a
sparse term: fused_decode_gear.py builds its kernel from this one's source with code at its
hook lines (affine_partials_source.partials_source), and launches it through affine_partials
and merge_partials.

The portable path (base CompressedKVCache._attend over mx.quantized_matmul) stays the fallback:
it runs on the CPU and Metal, and wherever this kernel is not active. tests/cache/test_fused_decode.py
checks the kernels against it on CUDA, and their algorithm (tests/cache/split_softmax_reference.py)
against it on the CPU.

`VELOXQUANT_CUDA_KERNELS=0` turns the kernel off (for A/B measurements); any value other than
0 or 1 is an error.
"""

from __future__ import annotations

import contextvars
from functools import lru_cache

import mlx.core as mx
import numpy as np

from veloxquant_mlx.cache import (
    affine_partials_source,
    environment_switch,
    kernel_header,
    partials_merge_source,
    window_buffer,
)
from veloxquant_mlx.cache.compiled_launch import COUNTED_EPILOGUE, COUNTED_PROLOGUE, CompiledLaunch, window_count
from veloxquant_mlx.cache.kernel_name import build_kernel
from veloxquant_mlx.cache.replay_step import ReplayStep
from veloxquant_mlx.errors import QuantizerConfigError

ENV_SWITCH = "VELOXQUANT_CUDA_KERNELS"
SUPPORTED_BITS = (2, 4, 8)

# This module's kernels' text, under the names every decode kernel module gives its own (the
# emulated tests' mutations and bench.batch_probe's variants patch them here): the header shared
# by every kernel of ours (kernel_header.py), the affine partials kernel (affine_partials_source.py)
# and the split build's merge kernel (partials_merge_source.py).
_HEADER = kernel_header.HEADER
_PARTIALS = affine_partials_source.PARTIALS
_MERGE = partials_merge_source.MERGE

# The affine kernel's work split (its text: affine_partials_source.py, which describes the tiles).
TILE = 128
TILE_SLOTS = TILE // 32 * 33  # p_tile's slots per warp (tile_slot: 4 runs of 32, one spare each)
WARPS_PER_BLOCK = 4
# The target of GEAR's and KVQuant's launches (and the emulation tests' knob for every kernel
# that takes it). Why 8192 and not 4096 (until session 27): tokens_per_block's ceil makes a
# warp's tiles jump from 2 to 3 just past 128K tokens (8 KV heads), and the grid then falls from
# 1024 blocks to ~690, 1.3 waves of the H200's resident blocks (132 SMs x 4: under nvrtc gear's
# kernel takes 103 registers and 44 KB of shared memory, kvquant's 119 and 36 KB, Nsight in
# session 28, results/ncu_raw_s28_*_128k.csv; nvcc's 96 would allow 5). One layer's chained
# attention on the H200 (bench.launch_bounds_probe --warps, results/lb_h200_s27_split_*.json),
# us at 4096 / 8192 target warps: at 131584 tokens gear 316 / 267, kvquant 337 / 299; at 131072
# gear 268 / 278, kvquant 295 / 279. Through the model at 128K (results/gpu_speed_h200_s27_128k_split.json)
# kvquant's GPU-bound steps took 3.75 ms with 8192 against 4.26 with 4096. Below 64K tokens
# (4096 tiles at 8 heads) both targets give one tile per warp: the same launches.
TARGET_WARPS = 8192
# The affine kernel's own launches (kivi, xquant: affine_launch's default split; GEAR's launch of
# the same source keeps TARGET_WARPS) aim at fewer warps, so each walks more tiles: on the H200
# one layer's whole chained attention (bench.launch_bounds_probe --set fused_decode.TARGET_WARPS=,
# which set both then) took at 32K kivi 62-66 us with 1024 warps against 74-79 with 4096, xquant
# 62-63 against 73-77, and at 128K kivi 160-171 (2048) / 170-171 (1024) against 173-178; 512
# was slower (~96 us at 32K, ~300 at 128K), and GEAR slower with 1024 (108-110 us at 32K
# against 95-96), hence its own target (results/lb_h200_s22*_tw*.json, session 22). Why fewer
# warps help: a model's layers run one after another, so a launch's ramp, its slowest SM and the
# merge of every block's partial are each layer's wait; half as many blocks halve the partials
# the last block merges, and a warp's second tile overlaps other warps' waits on memory.
AFFINE_TARGET_WARPS = 1024
# ... and twice as many where each warp would walk at least AFFINE_LONG_TILES_PER_WARP tiles at
# AFFINE_TARGET_WARPS (at 8 KV heads: from 96K tokens on). Why: since session 31's tensor-core
# loops kivi's kernel takes 134 registers, so an SM holds 3 of its blocks, and 2048 target warps
# (~520 blocks) keep more warps per scheduler than 1024 (~264 blocks, 2 per SM) where the
# history is long. One layer on the H200 (bench.launch_bounds_probe --warps 1024,2048,1024,2048,
# results/lb_h200_s31_tw_*.log, us): at 128K kivi 153.8 / 152.3 with 1024 against 140.5 / 146.6
# with 2048, xquant 143.1 / 146.0 against 133.9 / 134.0; at 96K kivi 118.4 / 117.7 against
# 112.7 / 112.5, xquant 117.6 / 118.0 against 112.0 / 110.6; at 64K (4 tiles per warp) 2048
# was slower: kivi 91.3 / 95.0 against 97.8 / 105.0, xquant 84.7 / 85.1 against 91.7 / 89.6.
AFFINE_LONG_TILES_PER_WARP = 6


# One launch per decode step: the partials kernel's last block per (batch*kv-head) merges the
# blocks' partials (vq_merge_if_last) where a second kernel (partials_merge_source.MERGE) did. Why: on the H200 the
# decode step is bound by the host, not the GPU (each token's host time, graph built and handed
# to async_eval, is its whole interval: fp16 1.67 ms, kivi 1.91 ms per 8-layer step at 32K,
# results/gpu_speed_h200_s7_32k_host.json), and one mx.fast.cuda_kernel call costs the host
# ~23 us there (12 us to build, 11 us to launch; a built-in op ~4.5 us: mx.add 1.1 + 3.5; the
# README's H200 section, session 7), so the merge kernel cost every layer ~23 us of each step.
# The partials live in a float32 scratch and the per-head counters in inputs that outlive the
# launch (FusedLaunchState), not in outputs: MLX fills every output of a launch given
# init_value, one more kernel each (results/launch_cost_h200_s8.json: a call's launch 11.9 us,
# 23.8 us with init_value), and each output costs the host ~5 us. False: the two kernels.
MERGE_IN_KERNEL = True


# Where set, a fused decode launch passes MLX no template: its constants are written into the
# kernel's source instead (PartialsKernel.baked: one kernel object per set of constants), as the
# lines MLX itself writes for them, so the compiled kernel is the same. Why: on the H200 the
# Python function making a decode launch took 26-28 us of own time per layer and step under
# cProfile (session 33, results/host_profile_h200_s33_decode.json: the mx.fast.cuda_kernel call
# inside it), against ~3 us for mlx-lm's attention, and MLX converts, hashes and formats every
# template constant at every call (a decode launch has up to 27). Off until the H200 times it:
# bench.launch_cost's constant cases, and the `<method>-baked` ablations (a cache's own
# `baked_constants` attribute) in gpu_speed --interleave.
BAKED_CONSTANTS = False

# Where set (as shipped since session 36), a cache's fused decode launches go through mx.compile
# (cache/compiled_launch.py: MLX replays the traced kernel call, none of the call's host work is
# done again), the window's filled rows passed as data; a cache whose decode kernels run then
# writes its decode window in place (base.py, window_buffer.py): a window concatenated each step
# changes shape each step, and each new shape is a new trace. Why on: the H200's decode step
# waits on the host, and in one interleaved 32K run (results/gpu_speed_h200_s36_32k_compact_
# compiled.json) the compiled launch's paired ratio to fp16 was 0.89-0.93 against 0.87-0.89
# for the uncompiled one, per method (0-0.04 in session 35's two runs). A cache's own
# `compiled_launch` decides instead where set (the `<method>-uncompiled` ablations: False).
COMPILED_LAUNCH = True

# MLX's CUDA type name per dtype (its dtype_to_cuda_type), for constants written into a source.
_CUDA_TYPE_NAMES = {
    mx.bool_: "bool", mx.int8: "int8_t", mx.int16: "int16_t", mx.int32: "int32_t", mx.int64: "int64_t",
    mx.uint8: "uint8_t", mx.uint16: "uint16_t", mx.uint32: "uint32_t", mx.uint64: "uint64_t",
    mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.float32: "float",
}


def constants_source(template) -> str:
    """The lines MLX's CUDA backend writes into a kernel's body for its template constants
    (custom_kernel.cpp, build_kernel), in their order, and the blank line after them:
    `constexpr int N = 3;`, `constexpr bool F = true;`, `using T = __nv_bfloat16;`."""
    lines = []
    for name, value in template:
        if isinstance(value, bool):
            lines.append(f"  constexpr bool {name} = {'true' if value else 'false'};\n")
        elif isinstance(value, (int, np.integer)):
            lines.append(f"  constexpr int {name} = {int(value)};\n")
        elif isinstance(value, mx.Dtype) and value in _CUDA_TYPE_NAMES:
            lines.append(f"  using {name} = {_CUDA_TYPE_NAMES[value]};\n")
        else:
            raise QuantizerConfigError(
                f"decode kernel template constant {name}={value!r}: allowed is an int, a bool or one "
                f"of the dtypes {sorted(map(str, _CUDA_TYPE_NAMES))}"
            )
    return "".join(lines) + "\n" if lines else ""


# The fused build's inputs beyond the partials kernel's own: the counters, the partials'
# scratch, and the launch this one must follow (FusedLaunchState.after), which the kernel never
# reads.
FUSED_EXTRA_INPUTS = ("counts", "scratch", "after")

# Floats the scratch grows by (64 K floats, 256 KB): a longer history needs more blocks, and a
# scratch a little larger than needed spares a new one at each such step.
SCRATCH_STEP = 1 << 16


class FusedLaunchState:
    """What successive fused launches of one cache share: the per-head counters (int32, left at
    zero by every launch), the partials' scratch (float32) and the last launch's output.
    Why the scratch is an input, not an output: each output of a launch costs the host ~2.5 us
    to build and ~2.5 us to launch (results/launch_cost_h200_s10.json: one output 5.8 + 5.0 us,
    three 10.9 + 10.1), every layer and step; kept here it is allocated once per size.
    Why the output: two launches sharing counters and scratch must not overlap. A later launch
    takes the last one's output as an input it never reads (`after`), so MLX orders the two
    within one evaluated graph as it orders any producer and consumer (its CUDA graphs run nodes
    without a path between them concurrently); launches in different evaluations run in stream
    order."""

    def __init__(self):
        self.counts = None
        self.scratch = None
        self.last_out = None
        self.compiled = CompiledLaunch()  # the cache's compiled launch, where it has one

    def inputs(self, queries, scratch_size: int, counters: int) -> list:
        """[counts, scratch, after] for a launch whose partials take `scratch_size` floats and
        whose merge counts in `counters` int32 (merge_counters). Counters are kept while enough:
        every launch leaves them all at zero, so a launch of fewer heads or groups finds its own
        at zero too."""
        if self.counts is None or self.counts.shape[0] < counters:
            self.counts = mx.zeros((counters,), dtype=mx.int32)
        if self.scratch is None or self.scratch.shape[0] < scratch_size:
            self.scratch = mx.zeros((-(-scratch_size // SCRATCH_STEP) * SCRATCH_STEP,), dtype=mx.float32)
        return [self.counts, self.scratch, self.after(queries)]

    def after(self, queries):
        """What the next launch follows: the last launch's output where it has the queries'
        dtype, else the queries (nothing to follow: an input already there, of the same dtype)."""
        after = self.last_out
        return queries if after is None or after.dtype != queries.dtype else after


def group_partials(n_blocks: int) -> int:
    """Partials per head of the fused merge's groups (the kernel's NG where it merges in two
    levels, past kernel_header.MERGE_GROUP blocks; 0 at one level, where it keeps none)."""
    return -(-n_blocks // kernel_header.MERGE_GROUP) if n_blocks > kernel_header.MERGE_GROUP else 0


def scratch_floats(heads: int, n_blocks: int, rows: int, value_dim: int) -> int:
    """Floats of the fused kernel's scratch: the blocks' partials (o, m, l), then the groups'
    (vq_merge_if_last's two levels)."""
    return heads * (n_blocks + group_partials(n_blocks)) * rows * (value_dim + 2)


def merge_counters(heads: int, n_blocks: int) -> int:
    """Counters of the fused merge: one per head, then one per head and group at two levels."""
    return heads * (1 + group_partials(n_blocks))


class PartialsKernel:
    """A flash-decoding partials kernel in its two builds: as written (outputs part_o, part_m,
    part_l, merged by merge_partials' kernel) and with the merge fused in (outputs the attention
    `out`; the partials go to FusedLaunchState's scratch), built on first use. Every partials
    kernel of ours launches blocks of WARPS_PER_BLOCK warps on a grid of (n_blocks, batch * kv
    heads) and has R and DV among its template constants."""

    def __init__(self, name: str, input_names, source: str, header: str):
        self.name, self.input_names, self.source, self.header = name, list(input_names), source, header
        self._split = self._fused = self._counted = self._counted_inline = self._verbatim = None
        self._baked = {}  # template constants (a tuple) -> the fused build with them in its source

    @property
    def split(self):
        if self._split is None:
            self._split = build_kernel(
                mx.fast.cuda_kernel,
                name=self.name, input_names=self.input_names,
                output_names=["part_o", "part_m", "part_l"], source=self.source, header=self.header)
        return self._split

    def fused_source(self, before: str = "", after: str = "") -> str:
        """The source with the merge fused in, as written (`before` / `after`: lines written
        before and after it: template constants, compiled_launch's counted window)."""
        return before + partials_merge_source.FUSED_PROLOGUE + self.source + partials_merge_source.FUSED_EPILOGUE + after

    def _fused_build(self, suffix: str = "", before: str = "", after: str = "", compact: bool = True,
                     files: bool = True):
        """fused_source(before, after) built under this kernel's name + "_merged" + `suffix`;
        `compact`, `files`: build_kernel's."""
        return build_kernel(
            mx.fast.cuda_kernel,
            name=self.name + "_merged" + suffix, input_names=[*self.input_names, *FUSED_EXTRA_INPUTS],
            output_names=["out"], source=self.fused_source(before, after), header=self.header,
            compact=compact, files=files)

    @property
    def fused(self):
        if self._fused is None:
            self._fused = self._fused_build()
        return self._fused

    @property
    def verbatim(self):
        """The fused build with its header and source as written, comments and indentation in
        (kernel_text): the `<method>-verbatim` ablations' launch, for what compacting is worth."""
        if self._verbatim is None:
            self._verbatim = self._fused_build("_verbatim", compact=False)
        return self._verbatim

    @property
    def counted(self):
        """The fused build reading the window's filled rows as data (wn[0], an int32 count:
        compiled_launch.window_count) instead of wn's length: the compiled launch's kernel."""
        if self._counted is None:
            self._counted = self._fused_build("_counted", COUNTED_PROLOGUE, COUNTED_EPILOGUE)
        return self._counted

    @property
    def counted_inline(self):
        """The counted build with its compacted text handed to MLX inline rather than as
        #includes of files (kernel_files): the `<method>-inline` ablations' compiled launch, for
        what the files save of a replay's host time. Its name is the counted build's (the same
        code: MLX's module cache serves both)."""
        if self._counted_inline is None:
            self._counted_inline = self._fused_build("_counted", COUNTED_PROLOGUE, COUNTED_EPILOGUE, files=False)
        return self._counted_inline

    def baked(self, template):
        """The fused build with `template`'s constants written into its source (BAKED_CONSTANTS),
        launched with no template; built once per set of constants."""
        key = tuple(template)
        kernel = self._baked.get(key)
        if kernel is None:
            kernel = self._baked[key] = self._fused_build("_baked", constants_source(key))
        return kernel

    def partials(self, queries, *, inputs, template, n_blocks: int, heads: int, value_dim: int):
        """The split build's launch -> (part_o, part_m, part_l)."""
        return split_launch(self.split, queries, inputs=inputs, template=template, n_blocks=n_blocks,
                            heads=heads, value_dim=value_dim)

    def attend(self, queries, *, inputs, template, n_blocks: int, heads: int, value_dim: int,
               state: FusedLaunchState | None = None, baked: bool | None = None, compiled: bool = False,
               verbatim: bool = False, inline: bool = False):
        """The attention output (B, Hq, 1, DV) in the queries' dtype: one fused launch
        (MERGE_IN_KERNEL), else the split build and merge_partials. `state`: the cache's
        FusedLaunchState (None: one for this launch alone); `baked`: the fused launch's
        constants written into its source (None: BAKED_CONSTANTS); `compiled`: the counted
        build through the state's CompiledLaunch (mx.compile), `inputs` holding the window's
        count (compiled_launch.window_count) as wn; `verbatim`: the fused build with its text
        as written (PartialsKernel.verbatim), for the bench's ablation; `inline`: the compiled
        launch's text handed to MLX inline (PartialsKernel.counted_inline), likewise."""
        in_source = BAKED_CONSTANTS if baked is None else baked
        if verbatim and (in_source or compiled or not MERGE_IN_KERNEL):
            raise QuantizerConfigError(
                "decode kernels: the text-as-written build (a cache's kernel_text_as_written) is "
                "the plain fused launch's; it takes no constants in the source (BAKED_CONSTANTS or "
                "baked_constants), no compiled launch (COMPILED_LAUNCH or compiled_launch) and "
                "needs MERGE_IN_KERNEL: set one of them"
            )
        if in_source and compiled:
            raise QuantizerConfigError(
                "decode kernels: a compiled launch (COMPILED_LAUNCH or a cache's compiled_launch) "
                "handles its template constants at its trace only; constants in the source "
                "(BAKED_CONSTANTS or baked_constants) are for the uncompiled launch: set one of the two"
            )
        if not MERGE_IN_KERNEL:
            if in_source or compiled:
                raise QuantizerConfigError(
                    "decode kernels: constants in the source (BAKED_CONSTANTS or a cache's "
                    "baked_constants) and compiled launches (COMPILED_LAUNCH or compiled_launch) "
                    "apply to the fused launch only; MERGE_IN_KERNEL is off"
                )
            return merge_partials(*self.partials(queries, inputs=inputs, template=template, n_blocks=n_blocks,
                                                 heads=heads, value_dim=value_dim), queries)
        B, n_q_heads = queries.shape[:2]
        rows = n_q_heads * B // heads
        state = FusedLaunchState() if state is None else state
        scratch_size = scratch_floats(heads, n_blocks, rows, value_dim)
        arrays = [*inputs, *state.inputs(queries, scratch_size, merge_counters(heads, n_blocks))]
        launch = dict(grid=(32 * WARPS_PER_BLOCK * n_blocks, heads, 1), threadgroup=(32 * WARPS_PER_BLOCK, 1, 1))
        if compiled:
            kernel = self.counted_inline if inline else self.counted
            out = state.compiled(kernel, arrays, template=template, output_shape=(B, n_q_heads, 1, value_dim),
                                 output_dtype=queries.dtype, **launch)
        else:
            kernel, constants = (self.baked(template), []) if in_source else (
                self.verbatim if verbatim else self.fused, template)
            out = kernel(inputs=arrays, template=constants, output_shapes=[(B, n_q_heads, 1, value_dim)],
                         output_dtypes=[queries.dtype], **launch)[0]
        state.last_out = out
        return out


def split_launch(kernel, queries, *, inputs, template, n_blocks: int, heads: int, value_dim: int):
    """A partials kernel as written (the shipped split build, or a variant of its source that
    bench.kernel_probe times) on its grid of (n_blocks, heads) blocks -> (part_o, part_m,
    part_l) (heads, n_blocks, rows, DV) / (heads, n_blocks, rows) in float32."""
    rows = queries.shape[0] * queries.shape[1] // heads
    return kernel(
        inputs=inputs, template=template, grid=(32 * WARPS_PER_BLOCK * n_blocks, heads, 1),
        threadgroup=(32 * WARPS_PER_BLOCK, 1, 1),
        output_shapes=[(heads, n_blocks, rows, value_dim), (heads, n_blocks, rows), (heads, n_blocks, rows)],
        output_dtypes=[mx.float32, mx.float32, mx.float32],
    )


def kernels_enabled() -> bool:
    """True when the CUDA kernel should run: MLX's CUDA backend is the default GPU device and
    VELOXQUANT_CUDA_KERNELS is not 0. The variable is read at every call (environment_switch:
    the switch may be set while the process runs)."""
    switch = environment_switch.value(ENV_SWITCH, "1")
    if switch not in ("0", "1"):
        raise QuantizerConfigError(
            f"environment variable {ENV_SWITCH}={switch!r} is invalid: allowed is 0 (portable "
            "ops only) or 1 (CUDA kernel where MLX runs on CUDA, the default)"
        )
    return switch == "1" and _on_cuda()


def _on_cuda() -> bool:
    return _cuda_available() and mx.default_device() == mx.gpu


@lru_cache(maxsize=None)
def _cuda_available() -> bool:
    """Whether MLX has its CUDA backend here: fixed for the process, asked once (the question
    cost ~2.5 us of host time at every layer and decode step on the H200, where it asks the
    driver; the default device, which a caller may change, is read at each call)."""
    cuda = getattr(mx, "cuda", None)
    return cuda is not None and cuda.is_available()


# Kernel 1's inputs, in launch order (a kernel built on it by affine_partials_source.partials_source
# appends its own).
PARTIALS_INPUTS = ("q", "kc", "ks", "kz", "vc", "vs", "vz", "wk", "wv", "sk", "sv", "meta", "wn")


@lru_cache(maxsize=None)
def _kernels():
    partials = PartialsKernel("vq_affine_decode_partials", PARTIALS_INPUTS, _PARTIALS, _HEADER)
    merge = build_kernel(
        mx.fast.cuda_kernel,
        name="vq_affine_decode_merge",
        input_names=["part_o", "part_m", "part_l"],
        output_names=["out"],
        source=_MERGE,
        header=_HEADER,
    )
    return partials, merge


def affine_tokens_per_block(n_valid: int, n_heads: int) -> int:
    """History tokens per block of the affine kernel's own launches: AFFINE_TARGET_WARPS, twice
    that where each warp would walk AFFINE_LONG_TILES_PER_WARP tiles or more."""
    tiles = -(-n_valid // TILE) * n_heads
    long = tiles >= AFFINE_LONG_TILES_PER_WARP * AFFINE_TARGET_WARPS
    return tokens_per_block(n_valid, n_heads, target_warps=AFFINE_TARGET_WARPS * (2 if long else 1))


# The target warps of the cache whose launch plan is being built, where it has its own
# (CompressedKVCache.decode_target_warps, set by the `<method>-tw<N>` bench ablations): taken by
# tokens_per_block over every kernel's own target while planned_attend builds that plan.
_PLAN_TARGET_WARPS: contextvars.ContextVar = contextvars.ContextVar("plan_target_warps", default=None)


def tokens_per_block(n_valid: int, n_heads: int, tile: int = TILE, max_tiles: int = 64,
                     target_warps: int | None = None) -> int:
    """History tokens per block of 4 warps: tiles of `tile` tokens, enough warps to fill the GPU
    (`target_warps`, default TARGET_WARPS, over all heads; a cache's own while its launch plan
    is built) and at most `max_tiles` tiles per warp. The other partials kernels call it with
    their own tile, bound and target."""
    own = _PLAN_TARGET_WARPS.get()
    warps = own if own is not None else TARGET_WARPS if target_warps is None else target_warps
    tiles = -(-n_valid // tile) * n_heads
    tiles_per_warp = min(max_tiles, max(1, -(-tiles // warps)))
    return tile * WARPS_PER_BLOCK * tiles_per_warp


# Value accumulators per lane (rows x channels) above which a token is split over more lanes
# (at most MAX_LANES_PER_TOKEN). At 8 query rows per KV head 16 channels per lane made 128
# accumulators and the kernel spilled (ptxas for sm_90: 255 registers + 72 bytes of stack;
# tests/cache/test_kernels_nvcc.py); at 4 rows, 8 channels per lane instead of 16 take 104
# registers instead of 184 (more warps per SM) and the partials ran 0.086 ms instead of 0.092 at
# 32K tokens on the H200 (bench.kernel_probe, results/kernel_probe_decode_h200_s4.json; 32 lanes
# of 4 channels: 0.090).
MAX_LANE_ACCUMULATORS = 32
MAX_LANES_PER_TOKEN = 16

# The exact block (sink and window, one block per head) reads its rows 16 bytes a load instead
# of one element a load (template WRV). Why: Nsight on the H200 (results/ncu_full_s21_kivi_
# decode.csv, kivi at 32K) finds the launch's SMs active 73 K of 125 K cycles on average, the
# busiest 38% above the average as if one of its blocks cost ~2.4 history blocks: the exact
# block's lanes each read a token row as D two-byte loads, a warp load touching 32 rows. Off
# (0): measured on the H200 (session 22, results/kernel_probe_h200_s22_rowvec.json) it is no
# faster: kivi's partials 0.0530 against 0.0537 ms at 32K, 0.149 against 0.141 at 128K; the
# exact block is no tail either (the partials without its tokens 0.0503 ms at 32K, with only
# them 0.0179). Correct on the GPU (results/cuda_tests_h200_s22_rowvec.txt).
WINDOW_ROW_VECTORS = 0


def window_row_vectors(head_dim: int, lane_channels: int, dtype) -> int:
    """WRV for a launch: 1 where WINDOW_ROW_VECTORS is set and a key row and a lane's value
    channels are whole 16-byte vectors of the queries' dtype, else 0."""
    size = dtype.size
    return int(bool(WINDOW_ROW_VECTORS) and head_dim * size % 16 == 0 and lane_channels * size % 16 == 0)


# The history's scores on tensor cores (template MMA: one mma.sync.m16n8k16 per 16 tokens x 16
# channels x 8 query rows, the codes turned into fp16 by bit operations, the scales folded into
# the queries in fp16). Why: Nsight on the H200 (results/ncu_full_s21_kivi_decode.csv) finds the
# decode kernel issuing instructions 61% of its active cycles, ~11 K instructions per warp and
# 128-token tile; the FMA loop spends ~2 instructions per multiply-add of the scores (a code's
# extraction, conversion and dequantization, then one FMA per query row). Taken where
# mma_scores() allows it (16-bit queries: the fp16 rounding of the scaled queries stays below
# the queries' own; 2-bit keys; the whole tile's keys staged at once); elsewhere, and on GPUs
# before sm_80, the FMA loop. Alone, measured on the H200 (session 22) it is no faster, so the
# scores' instructions are not what bounds the kernel: one kivi layer's partials at 32K 0.0587
# ms against 0.0581, at 128K 0.146 against 0.144 (results/kernel_probe_h200_s22_mma.json); the
# whole chained attention (launch_bounds_probe) kivi 177 against 180 us at 128K, gear 272
# against 271, at 32K within the runs' +-10 us (results/lb_h200_s22_*.json). Its values'
# loads issued before the scores (registers 166: 3 blocks per SM) were slower still (kivi 184,
# gear 318 us at 128K). Correct on the GPU (tests/cache/test_fused_decode.py -m cuda).
# On (1) since session 30, with the tensor-core values (MMA_VALUES): together they are faster
# where either alone is not (bench.batch_probe, one kivi layer at 128K on the H200, two
# machines: shipped 170 / 170 us, scores alone 181 / -, values alone 166 / 170, both 163 / 159;
# results/batch_probe_h200_s30_kivi.json, ..._kivi_b.json), and through the 8-layer model in
# one interleaved run per context (`kivi-tc` against `kivi` then, results/gpu_speed_h200_s30_*):
# paired to fp16 at 128K 1.63x against 1.54x, and 1.23x / 1.20x (0.93x / 0.90x in fp16's
# host-bound rounds); at 32K 1.13x / 1.12x and 0.94x / 0.91x. GEAR's build keeps its FMA scores
# (fused_decode_gear.MMA_SCORES: not measured with its terms since session 22).
MMA_SCORES = 1


# The history's values weighed on tensor cores (template MMAV: per 16 tokens one
# mma.sync.m16n8k16 per 16 channels, C = channels x query rows, A = 1 + code / 4 from the staged
# 2-bit codes by a byte permute, a rotation and a mask, B = p x scale in the side data's 16-bit
# type, the zeros' term in float32). Why: session 30's arithmetic for kivi at 128K (2-bit, 4
# rows, ~75 M warp instructions per layer at ~50% issue efficiency, ~165 us on the H200) puts
# ~8 instructions on each value code in the FMA loop (extraction, conversion, dequantization,
# one FMA per query row), ~2 here. Taken by the affine kernel's own launches (kivi, xquant; GEAR's
# build adds its own terms to the FMA loop's accumulators and passes value_mma=False) for
# 16-bit queries and side data (a float32 model's kivi keeps fp16 scales: its float32 FMA loop
# stays), 2-bit values, channels and groups multiples of 16, at most 8 query rows and
# a value stage of whole 16-token steps. On since session 30, with the tensor-core scores
# (MMA_SCORES' note has the figures).
MMA_VALUES = 1

# Each history tile asks L2 for the warp's next tile's keys and its own values before staging
# its keys (template PF; every kernel built on this source, GEAR's too). Why tried: bench.
# batch_probe on the H200 (session 30, results/batch_probe_h200_s30_kivi.json), one kivi layer
# at 128K: 170 us as shipped, 103 with the key loop cut (stage and scores), 175 with the value
# loop cut: the keys' stage (a 32-byte run of each of 128 channel rows, rows a capacity apart)
# and its scores cost ~67 us, the values (contiguous) nothing that shows. Off: measured slower
# (batch_probe's `pf`, results/batch_probe_h200_s30_kivi_b.json, us per layer): kivi 183
# against 170 at 128K, 70.9 against 69.0 at 32K; GEAR's build 268 against 256 at 128K (90.8
# against 94.6 at 32K). The same run split the keys' cost: staged but never scored 120 us,
# scored from a stage never filled 164, neither 99: the scores' arithmetic, not the stage's
# loads, is the ~65 us (what the tensor-core scores and values, on since, take from).
L2_PREFETCH = 0


def mma_values(value_dim: int, rows: int, group_size: int, value_bits: int, dtype, side, stage,
               switch: bool | None = None) -> int:
    """MMAV of a launch: 1 where MMA_VALUES is set (or `switch`, where not None: a cache's own
    `mma_values`, the bench ablation `<method>-mmav`) and the launch is one it takes (above),
    else 0. `dtype`: the queries'; `side`: the scales' and zeros'; `stage`: the launch's stage
    template (its VST)."""
    on = MMA_VALUES if switch is None else switch
    ok = (on and dtype in (mx.float16, mx.bfloat16) and side in (mx.float16, mx.bfloat16)
          and value_bits == 2 and value_dim % 16 == 0
          and group_size % 16 == 0 and rows <= 8 and stage is not None and dict(stage)["VST"] % 16 == 0)
    return int(bool(ok))


def mma_shared_bytes(head_dim: int, rows: int) -> int:
    """Static shared memory MMA adds: per warp one key group's B fragments (fp16 pairs of the
    lanes holding B's columns 0 .. rows - 1: 8 words per row and 16 channels)."""
    return WARPS_PER_BLOCK * head_dim // 16 * 8 * rows * 4


def mma_plan(head_dim: int, value_dim: int, rows: int, group_size: int, key_bits: int,
             value_bits: int, side_bytes: int, extra_shared: int, dtype, switch: bool | None = None):
    """(MMA, stage template) of a launch: MMA 1 where MMA_SCORES is set (or `switch`, where not
    None: a cache's own `mma_scores`, the bench ablation `<method>-tc`), the queries are 16-bit,
    the keys 2-bit, head_dim and the group multiples of 16, at most 8 query rows (the mma's
    8 columns) dividing 32, and the whole tile's keys fit one stage beside the B fragments;
    else 0 and the stage without them (None where no stage fits: supports() refuses)."""
    on = MMA_SCORES if switch is None else switch
    if (on and dtype in (mx.float16, mx.bfloat16) and key_bits == 2 and head_dim % 16 == 0
            and group_size % 16 == 0 and rows <= 8 and 32 % rows == 0):
        stage = stage_template(head_dim, value_dim, rows, group_size, key_bits, value_bits, side_bytes,
                               extra_shared + mma_shared_bytes(head_dim, rows))
        if stage is not None and dict(stage)["KSC"] == head_dim:
            return 1, stage
    return 0, stage_template(head_dim, value_dim, rows, group_size, key_bits, value_bits, side_bytes,
                             extra_shared)


def history_blocks(tokens: int, n_heads: int, label: str, split=None) -> tuple[int, int, int]:
    """(tokens per block, history blocks, all blocks) of a partials launch over `tokens` history
    tokens per head: `split`'s tokens per block (a kernel's own tokens_per_block; default this
    module's) plus the one block of exact tokens, checked against the merge kernel's MAX_BLOCKS
    (beyond millions of tokens per head: not reached in practice). `label` names the kernel in
    the error."""
    per_block = (split or tokens_per_block)(tokens, n_heads)
    n_hist_blocks = -(-tokens // per_block)
    n_blocks = n_hist_blocks + 1
    if n_blocks > partials_merge_source.MAX_BLOCKS:
        raise QuantizerConfigError(
            f"{label}: {tokens} history tokens need {n_blocks} blocks, more than the merge "
            f"kernel's {partials_merge_source.MAX_BLOCKS}; set {ENV_SWITCH}=0 to use the portable path"
        )
    return per_block, n_hist_blocks, n_blocks


def lanes_per_token(value_dim: int, value_bits: int, rows: int = 4) -> int | None:
    """Lanes that share one value token, or None when a token is not whole words. Each lane
    reads whole code words (the largest power of two up to 8 dividing the token's words); with
    many query rows the lanes double (up to 32) while rows x channels per lane exceeds
    MAX_LANE_ACCUMULATORS, down to a half or a quarter word per lane (a lane's bits never
    straddle a word): the configurations run on the H200."""
    if (value_dim * value_bits) % 32:
        return None
    words = value_dim * value_bits // 32
    lanes = next(n for n in (8, 4, 2, 1) if words % n == 0)
    while rows * value_dim // lanes > MAX_LANE_ACCUMULATORS and lanes < MAX_LANES_PER_TOKEN:
        bits = value_dim // (2 * lanes) * value_bits
        if value_dim % (2 * lanes) or not (bits % 32 == 0 or 32 % bits == 0):
            break
        lanes *= 2
    return lanes


def supports(head_dim: int, value_dim: int, group_size: int, key_bits: int, value_bits: int,
             rows: int = 4) -> bool:
    """The shapes the kernel handles; others take the portable path. Bits dividing 32 (codes
    never straddle words), groups of whole 32-token tiles, a lane's value channels inside one
    group."""
    if key_bits not in SUPPORTED_BITS or value_bits not in SUPPORTED_BITS or group_size % 32:
        return False
    lanes = lanes_per_token(value_dim, value_bits, rows)
    if lanes is None or group_size % (value_dim // lanes) or value_dim % 32:
        return False  # the merge kernel reduces over whole warps of value channels
    # Scales of 4 bytes (float32 queries) need the most stage.
    return 1 <= head_dim <= 256 and stage_template(head_dim, value_dim, rows, group_size, key_bits,
                                                   value_bits, 4) is not None


def shared_bytes(head_dim: int, value_dim: int, rows: int) -> int:
    """The partials kernel's static shared memory besides the history's stages (4-byte floats):
    the queries, per warp a tile's probabilities in TILE_SLOTS slots of `rows` floats (later the
    warp's partial), and per warp and row its max and sum (red_m, red_l)."""
    widest = max(head_dim, value_dim, TILE_SLOTS)
    # + bfrag's one word per warp where MMA is off (mma_shared_bytes where it is on)
    return 4 * rows * (head_dim + WARPS_PER_BLOCK * widest + 2 * WARPS_PER_BLOCK) + 4 * WARPS_PER_BLOCK


# A margin within CUDA's static shared memory (kernel_header.STATIC_SHARED_BYTES) for the fused
# merge's flag and the compiler's own.
SHARED_MARGIN = 64
# Each warp's stage of the history (kstage): up to this many bytes. 6 KB holds a whole tile of
# 2-bit keys or values with bf16 scales (128 x (32 + 16) bytes); 4 warps take 24 KB, so a block
# of the 8B shape (10.6 KB besides) still leaves 6 blocks per SM on an H200.
STAGE_BYTES = 6144


def stage_words(head_dim: int, value_dim: int, rows: int, extra_shared: int = 0,
                stage_bytes: int | None = None) -> int:
    """32-bit words of each warp's stage: `stage_bytes` (default STAGE_BYTES), or what the
    static shared limit leaves beside the kernel's other arrays (`extra_shared`: a kernel built
    on this one adds its own, GEAR's sparse sums), a multiple of 16 bytes."""
    stage_bytes = STAGE_BYTES if stage_bytes is None else stage_bytes
    free = (kernel_header.STATIC_SHARED_BYTES - SHARED_MARGIN - shared_bytes(head_dim, value_dim, rows)
            - extra_shared)
    return max(0, min(stage_bytes, free // WARPS_PER_BLOCK) // 16 * 4)


def key_stage_channels(head_dim: int, key_bits: int, group_size: int, side_bytes: int, words: int):
    """Key channels per stage (template KSC): the most dividing head_dim whose codes, scales and
    zeros over a tile fit `words`, or None (not even one fits)."""
    per_channel = TILE * key_bits // 8 + 2 * max(TILE // group_size, 1) * side_bytes
    fits = [c for c in range(1, head_dim + 1) if head_dim % c == 0 and c * per_channel <= 4 * words]
    return max(fits) if fits else None


def value_stage_tokens(value_dim: int, value_bits: int, group_size: int, side_bytes: int, words: int):
    """Value tokens per stage (template VST): the most of 8, 16, ..., TILE whose codes, scales
    and zeros fit `words`, each a whole number of 16-byte vectors, or None."""
    code_bytes, side = value_dim * value_bits // 8, value_dim // group_size * side_bytes
    fits = [t for t in (8, 16, 32, 64, 128) if t <= TILE and t * (code_bytes + 2 * side) <= 4 * words
            and t * code_bytes % 16 == 0 and t * side % 16 == 0]
    return max(fits) if fits else None


def stage_template(head_dim: int, value_dim: int, rows: int, group_size: int, key_bits: int,
                   value_bits: int, side_bytes: int, extra_shared: int = 0):
    """(("STAGE_WORDS", w), ("KSC", c), ("VST", t)) of a launch, or None where no stage fits."""
    return _stage_template(head_dim, value_dim, rows, group_size, key_bits, value_bits, side_bytes,
                           extra_shared, STAGE_BYTES)


@lru_cache(maxsize=None)
def _stage_template(head_dim, value_dim, rows, group_size, key_bits, value_bits, side_bytes,
                    extra_shared, stage_bytes):
    """stage_template's result for one STAGE_BYTES, cached: a launch plan is rebuilt at every
    block flush (a tuple: the cached entries cannot be changed by a caller)."""
    words = stage_words(head_dim, value_dim, rows, extra_shared, stage_bytes)
    channels = key_stage_channels(head_dim, key_bits, group_size, side_bytes, words)
    tokens = value_stage_tokens(value_dim, value_bits, group_size, side_bytes, words)
    if channels is None or tokens is None:
        return None
    return (("STAGE_WORDS", words), ("KSC", channels), ("VST", tokens))


def _meta(n_valid: int, per_block: int, n_hist_blocks: int, scale: float, n_skip: int,
          n_sink: int | None) -> mx.array:
    scale_bits = int(np.array([scale], dtype=np.float32).view(np.int32)[0])
    tail = [] if n_sink is None else [n_sink]
    return mx.array([n_valid, per_block, n_hist_blocks, scale_bits, n_skip, *tail], dtype=mx.int32)


class FusedDecodeMeta:
    """The small int32 argument array of one cache, rebuilt only when the history or the scale
    changes (every block flush), not at every decode step. Five entries; a sixth (n_sink) where
    given: this module's partials kernel reads it, the other kernels sharing the class do not."""

    def __init__(self):
        self._key = None
        self._value = None

    def get(self, n_valid: int, per_block: int, n_hist_blocks: int, scale: float,
            n_skip: int = 0, n_sink: int | None = None) -> mx.array:
        key = (n_valid, per_block, n_hist_blocks, scale, n_skip, n_sink)
        if key != self._key:
            self._key, self._value = key, _meta(*key)
        return self._value


def side_dtype(key_scales, key_zeros, value_scales, value_zeros, what: str):
    """The one dtype of a KIVI-layout cache's scales and zeros (the kernels' ST), refusing
    arrays that do not share it."""
    side = key_scales.dtype
    if {value_scales.dtype, key_zeros.dtype, value_zeros.dtype} != {side}:
        raise QuantizerConfigError(
            f"{what}: scales and zeros must share one dtype, got {key_scales.dtype}, "
            f"{key_zeros.dtype}, {value_scales.dtype}, {value_zeros.dtype}"
        )
    return side


def decode_step(cache, queries, scale: float, arrays, *, group_size: int, key_bits: int,
                value_bits: int, skip: int = 0, exact_prefix=None, plan_key=()):
    """A KIVI-layout cache's decode-step attention through the kernels, or None where they are
    not active (off CUDA, switched off, a shape supports() refuses): the cache then takes the
    portable path. `arrays()` gives (key codes, scales, zeros, value codes, scales, zeros); it is
    only called when the kernels run. The window, history length and heads come from `cache`.
    `skip`: leading compressed tokens to ignore; `exact_prefix`: (keys, values) (B, H, S, D /
    DV) attended exactly before the window (a cache holding its first tokens exactly passes
    both): kernel inputs of their own (sk, sv), not concatenated to the window, so the step
    launches the kernel(s) and nothing else. `plan_key`: what else the arrays depend on (a
    cache reading another layer's store passes that store's state)."""
    if not kernels_enabled():
        return None
    key = (skip, group_size, key_bits, value_bits, plan_key,
           None if exact_prefix is None else (id(exact_prefix[0]), id(exact_prefix[1])))

    def launch():
        rows = queries.shape[1] // cache.n_kv_heads
        if not supports(cache.head_dim, cache.value_dim, group_size, key_bits, value_bits, rows):
            return None
        # The meta array belongs to the cache (it changes with its history), made on first use.
        meta_cache = cache.__dict__.setdefault("_fused_meta", FusedDecodeMeta())
        _, inputs, shape = affine_launch(
            queries, scale, *arrays(), cache.window_keys, cache.window_values,
            n_valid=cache.n_compressed, group_size=group_size, key_bits=key_bits,
            value_bits=value_bits, n_kv_heads=cache.n_kv_heads, meta_cache=meta_cache, skip=skip,
            sink=exact_prefix, score_mma=cache.__dict__.get("mma_scores"),
            value_mma=cache.__dict__.get("mma_values"),
        )
        return inputs, shape, WINDOW_INPUTS

    return planned_attend(cache, queries, scale, key, launch, lambda: _kernels()[0])


# Zero bytes a window_rows view is cut from, grown to the next power of two a window needs.
_ROWS_BASE = [mx.zeros((256,), dtype=mx.uint8)]


@lru_cache(maxsize=None)
def window_rows(n: int) -> mx.array:
    """The decode kernels' `wn` input: an (n,) view of one zero array, whose length is the
    window's filled rows (the kernels read wn_shape[0]; its bytes are never read). Why an input
    and not the meta: the window grows by a token each step, the meta is kept per launch plan,
    and a view costs no launch. With it the window inputs may be the cache's in-place buffers,
    whose rows beyond n are slack (wk_shape[2] is then their row count per head).
    Not evaluated here: its first step's graph evaluates it (a slice: a view, no launch), and
    later steps reuse the evaluated array (lru_cache). Until session 24 it was evaluated here,
    and mx.eval waits for every launch queued before it: on the H200 each window length's first
    step in a process waited for the previous step's GPU work, ~1.3 ms per step for GEAR's first
    255 decode tokens (its window cycles through 1..255; results/host_first_steps_h200_s24*.json),
    which slowed its figures in every gpu_speed run until its window had seen every length once."""
    if n < 1:
        raise QuantizerConfigError(f"decode kernels: a window of {n} rows; allowed is at least 1 (the step's token)")
    base = _ROWS_BASE[0]
    if base.shape[0] < n:
        base = mx.zeros((1 << (n - 1).bit_length(),), dtype=mx.uint8)
        _ROWS_BASE[0] = base
    return base[:n]


def window_inputs(cache, dtype, held, counted: bool = False) -> tuple:
    """(keys, values, rows) for a decode kernel's wk, wv, wn: `held` = cache.window_buffers(),
    the window's buffers when the cache keeps them in place (window_buffer.py: rows beyond the
    filled ones are slack, so the kernel reads the buffers as they are, without the copy a
    sliced view would cost), else None: the cache's window. `counted`: the rows as data
    (compiled_launch.window_count, for the counted build), else as a view's length."""
    keys, values, n = held if held is not None else (cache.window_keys, cache.window_values, cache.window_keys.shape[2])
    # astype makes a new array (a graph node) even to the same dtype: skipped when it is.
    keys = keys if keys.dtype == dtype else keys.astype(dtype)
    values = values if values.dtype == dtype else values.astype(dtype)
    return keys, values, window_count(n) if counted else window_rows(n)


def wants_compiled_launch(cache) -> bool:
    """Whether the cache's fused decode launches go through mx.compile where its kernels run:
    its own compiled_launch where set, else COMPILED_LAUNCH."""
    own = cache.__dict__.get("compiled_launch")
    return COMPILED_LAUNCH if own is None else own


def writes_window_in_place(cache) -> bool:
    """Whether a decode step writes the cache's window into its buffers in place because its
    launches are compiled (base.update_and_fetch): where its decode kernels run and it wants the
    compiled launch. Off the kernels (the CPU) the window grows by concatenation as shipped."""
    return wants_compiled_launch(cache) and kernels_enabled()


def compiles_launches(cache, buffered: bool) -> bool:
    """Whether this step's fused decode launch goes through mx.compile: where the cache wants it
    (wants_compiled_launch) and its window is the in-place buffers (`buffered`); a step whose
    window is not in place (the first token after a flush emptied it, or a prefill chunk's
    concatenation) launches uncompiled."""
    return buffered and wants_compiled_launch(cache)


def planned_attend(cache, queries, scale: float, key, launch, kernel):
    """A decode step through a launch plan kept on `cache` while its store writes, history
    length and capacity, the queries' shape and dtype, the scale and the caller's `key` (what
    else its launch depends on) are unchanged: `launch()` -> (inputs, {template,
    n_blocks, heads, value_dim}, window slots) or None (the kernel does not take this shape:
    the portable path, None here too), called when the key changed; each step swaps its queries
    (slot 0) and the cache's window (its slots, in the queries' dtype) into the plan's inputs.
    Why: the H200's decode step is host-bound (MERGE_IN_KERNEL's note), and rebuilding the
    checks, split, meta and constants at every step cost ~10 us of Python per layer on this
    machine's CPU (kivi 29 -> 18 us per layer-step with the kernels stubbed). `kernel()` gives
    the PartialsKernel, looked up at each step (not kept in the plan): a factory emptied or a
    constant set between two steps (the CUDA emulation, bench --set) takes effect.
    A plan's compiled steps after its first replay the traced launch on the step's arrays
    (replay_step.py; kivi's step census on this CPU 25.5 -> 20.9 us per layer and step,
    results/step_census_cpu_s37_replay_*.json), while the kernel, the launch state and the
    window's dtype stay those it holds."""
    # The window as in-place buffers (window_buffer.py) or None: the template's WB, the inputs.
    whole = window_buffer.held(cache)
    buffered = whole is not None
    own_warps = cache.decode_target_warps
    key = (cache.store_writes, cache.n_compressed, cache.capacity, queries.shape, queries.dtype, scale, buffered,
           own_warps, key)
    plan = cache.__dict__.get("_fused_plan")
    if plan is None or plan[0] != key:
        token = _PLAN_TARGET_WARPS.set(own_warps)
        try:
            built = launch()
        finally:
            _PLAN_TARGET_WARPS.reset(token)
        if built is not None:
            # The plan keeps no step's own arrays (the queries, the window): they would stay
            # alive until the next plan.
            inputs, shape, slots = built
            inputs = [None if i in (0, *slots) else a for i, a in enumerate(inputs)]
            if buffered:
                shape = {**shape, "template": [(k, 1 if k == "WB" else v) for k, v in shape["template"]]}
            built = (inputs, shape, slots)
        plan = (key, built)
        cache.__dict__["_fused_plan"] = plan
        # The old plan's replay holds its store arrays: they go with it, not a step later.
        cache.__dict__.pop("_fused_replay", None)
    if plan[1] is None:
        return None
    state = cache.__dict__.get("_fused_launch")
    if state is None:  # not setdefault: its argument, a new FusedLaunchState, was built every step
        state = cache.__dict__["_fused_launch"] = FusedLaunchState()
    compiled = compiles_launches(cache, buffered)
    replayable = compiled and not _other_fused_build(cache)
    partials = kernel()
    if replayable:
        # The plan's later compiled steps (replay_step.py); None where anything it holds moved.
        replay = cache.__dict__.get("_fused_replay")
        if replay is not None and replay.plan is plan:
            out = replay.run(partials, state, queries, whole)
            if out is not None:
                return out
    plan_inputs, shape, slots = plan[1]
    inputs = list(plan_inputs)
    inputs[0] = queries
    held = window_buffer.buffers_of(whole)
    inputs[slots[0]], inputs[slots[1]], inputs[slots[2]] = window_inputs(cache, queries.dtype, held, compiled)
    out = partials.attend(queries, inputs=inputs, state=state, baked=cache.__dict__.get("baked_constants"),
                          compiled=compiled, verbatim=cache.__dict__.get("kernel_text_as_written", False),
                          inline=cache.__dict__.get("kernel_text_inline", False), **shape)
    if replayable and whole[6] == whole[7] == queries.dtype:
        cache.__dict__["_fused_replay"] = ReplayStep(plan, partials, state, plan_inputs, slots, queries.dtype)
    return out


def _other_fused_build(cache) -> bool:
    """Whether the cache's decode launch is set to a build other than the compiled fused one:
    constants in the source, the text as written, or the merge out of the kernel (with a compiled
    launch attend refuses each, and the replay must not run it in their place)."""
    own = cache.__dict__
    baked = own.get("baked_constants")
    return bool((BAKED_CONSTANTS if baked is None else baked) or own.get("kernel_text_as_written", False)
                or not MERGE_IN_KERNEL)


def affine_decode_attention(
    queries, scale: float, key_codes, key_scales, key_zeros, value_codes, value_scales,
    value_zeros, window_keys, window_values, *, n_valid: int, group_size: int, key_bits: int,
    value_bits: int, n_kv_heads: int, meta_cache: FusedDecodeMeta, skip: int = 0, sink=None,
):
    """softmax(q K^T * scale) V for one query row per head, queries (B, Hq, 1, D), over the
    compressed tokens [skip, n_valid), the exact sink `sink` = (keys, values) (B, H, S, D / DV;
    None: none) and the exact window (B, H, W, D), W >= 1 -> (B, Hq, 1, DV) in the queries'
    dtype. Only call when kernels_enabled() and supports(...): decode_step checks."""
    return affine_partials(
        queries, scale, key_codes, key_scales, key_zeros, value_codes,
        value_scales, value_zeros, window_keys, window_values, n_valid=n_valid,
        group_size=group_size, key_bits=key_bits, value_bits=value_bits, n_kv_heads=n_kv_heads,
        meta_cache=meta_cache, skip=skip, sink=sink, merged=True,
    )


def affine_partials(
    queries, scale: float, key_codes, key_scales, key_zeros, value_codes, value_scales,
    value_zeros, window_keys, window_values, *, n_valid: int, group_size: int, key_bits: int,
    value_bits: int, n_kv_heads: int, meta_cache: FusedDecodeMeta, skip: int = 0, sink=None,
    kernel=None, extra_inputs=(), extra_template=(), merged: bool = False,
    state: FusedLaunchState | None = None, score_mma: bool | None = None, value_mma: bool | None = None,
):
    """Kernel 1's launch (the checks, block split, meta and template) -> (part_o, part_m,
    part_l), or with `merged` the attention output (B, Hq, 1, DV) (PartialsKernel.attend: the
    merge fused in, MERGE_IN_KERNEL, with `state`'s counters and scratch; None: new ones); `sink`: (keys, values) (B, H, S, D / DV) the exact block
    attends before the window (None: dummies, S = 0); `kernel`: the shipped PartialsKernel when
    None, else one built on this source by affine_partials_source.partials_source (GEAR's), or a raw variant kernel
    of its source (bench.kernel_probe times some; not with `merged`), taken after the checks;
    `extra_inputs` / `extra_template`: what such a kernel takes beyond this one's inputs (after
    `meta`) and template constants; `score_mma` / `value_mma`: affine_launch's."""
    launch = affine_launch(
        queries, scale, key_codes, key_scales, key_zeros, value_codes, value_scales, value_zeros,
        window_keys, window_values, n_valid=n_valid, group_size=group_size, key_bits=key_bits,
        value_bits=value_bits, n_kv_heads=n_kv_heads, meta_cache=meta_cache, skip=skip, sink=sink,
        kernel=kernel, extra_inputs=extra_inputs, extra_template=extra_template, score_mma=score_mma,
        value_mma=value_mma)
    partials, inputs, shape = launch
    if merged:
        return partials.attend(queries, inputs=inputs, state=state, **shape)
    if isinstance(partials, PartialsKernel):
        return partials.partials(queries, inputs=inputs, **shape)
    return split_launch(partials, queries, inputs=inputs, **shape)


# Where affine_launch's input list holds the window (keys, values): a step plan swaps them in.
WINDOW_INPUTS = (PARTIALS_INPUTS.index("wk"), PARTIALS_INPUTS.index("wv"), PARTIALS_INPUTS.index("wn"))


def affine_launch(
    queries, scale: float, key_codes, key_scales, key_zeros, value_codes, value_scales,
    value_zeros, window_keys, window_values, *, n_valid: int, group_size: int, key_bits: int,
    value_bits: int, n_kv_heads: int, meta_cache: FusedDecodeMeta, skip: int = 0, sink=None,
    kernel=None, extra_inputs=(), extra_template=(), extra_shared: int = 0, split=None,
    score_mma: bool | None = None, value_mma: bool | None = None,
):
    """The checks, block split, meta and template of kernel 1's launch (affine_partials) ->
    (kernel, inputs, {template, n_blocks, heads, value_dim}). `extra_shared`: the static
    shared bytes a kernel built on this one adds (the stages get what is left); `split`:
    (tokens, heads) -> history tokens per block (default affine_tokens_per_block);
    `score_mma` / `value_mma`: the tensor-core scores / values on or off for this launch (None:
    MMA_SCORES / MMA_VALUES)."""
    B, n_q_heads, _, D = queries.shape
    R = n_q_heads // n_kv_heads
    BH = B * n_kv_heads
    DV = value_codes.shape[-1] * 32 // value_bits
    side = side_dtype(key_scales, key_zeros, value_scales, value_zeros, "fused decode")
    check_skip(skip, n_valid, "fused decode")
    if value_codes.shape[2] % TILE:
        # The stages read whole tiles: the store's capacity grows in steps of 256 tokens.
        raise QuantizerConfigError(
            f"fused decode: the store's capacity {value_codes.shape[2]} is not a multiple of "
            f"the kernel's tile of {TILE} tokens")
    mma, stage = mma_plan(D, DV, R, group_size, key_bits, value_bits, side.size, extra_shared, queries.dtype,
                          score_mma)
    if stage is None:
        raise QuantizerConfigError(
            f"fused decode: no stage of the history fits the shared memory at head_dim {D}, "
            f"value_dim {DV}, {R} rows, {key_bits}/{value_bits} bits (supports() refuses it)")
    per_block, n_hist_blocks, n_blocks = history_blocks(n_valid, BH, "fused decode", split or affine_tokens_per_block)
    dtype = queries.dtype
    sink_keys, sink_values, n_sink = _sink_inputs(sink, queries, window_keys, window_values, DV)
    meta = meta_cache.get(n_valid, per_block, n_hist_blocks, float(scale), skip, n_sink)
    inputs = [queries, key_codes, key_scales, key_zeros, value_codes, value_scales, value_zeros,
              window_keys.astype(dtype), window_values.astype(dtype), sink_keys, sink_values,
              meta, window_rows(window_keys.shape[2]), *extra_inputs]
    lanes = lanes_per_token(DV, value_bits, R)
    # A kernel built on this source that adds its own value terms to the FMA loop's accumulators
    # (GEAR's) passes value_mma=False.
    mmav = mma_values(DV, R, group_size, value_bits, dtype, side, stage, value_mma)
    template = [("D", D), ("DV", DV), ("R", R), ("G", group_size), ("KB", key_bits),
                ("VB", value_bits), ("LPT", lanes), ("QT", dtype),
                ("ST", side), *stage, ("WB", 0), ("WRV", window_row_vectors(D, DV // lanes, dtype)),
                ("MMA", mma), ("MMAV", mmav), ("PF", int(bool(L2_PREFETCH))), *extra_template]
    kernel = _kernels()[0] if kernel is None else kernel
    return kernel, inputs, {"template": template, "n_blocks": n_blocks, "heads": BH, "value_dim": DV}


MAX_MIN_BLOCKS = 16  # an SM holds at most 2048 threads: 16 blocks of 128


def launch_bounds_header(min_blocks: int) -> str:
    """Header text that gives the kernel MLX generates after it `__launch_bounds__(128,
    min_blocks)` (0: none): ptxas then keeps the kernel's registers low enough for `min_blocks`
    blocks of WARPS_PER_BLOCK warps per SM (65536 registers: 5 blocks of 128 threads need <= 96 per
    thread, 6 need <= 80), spilling to local memory where it cannot.
    Why a redefinition: mx.fast.cuda_kernel writes the kernel's signature itself (`__global__
    void name(...)` after the header) and takes no launch bounds or register limit, and every
    decode kernel of ours sits at 4 blocks per SM, bound by registers (Nsight Compute on the H200,
    results/ncu_h200_s12.json: 102-128 registers, 25% theoretical occupancy, ~1 eligible warp per
    scheduler). The macro is redefined only under a CUDA compiler (nvrtc defines __CUDACC_RTC__,
    nvcc __CUDACC__; the CPU emulation's g++ neither), as CUDA's own headers define it
    (`__location__(global)`), and only the kernel's declaration follows this header."""
    if not isinstance(min_blocks, int) or isinstance(min_blocks, bool) or not 0 <= min_blocks <= MAX_MIN_BLOCKS:
        raise QuantizerConfigError(
            f"launch bounds: min_blocks={min_blocks!r} is invalid: allowed is an integer in 0..{MAX_MIN_BLOCKS} "
            "(0: no bounds)")
    if min_blocks == 0:
        return ""
    return kernel_declaration_header(f"__launch_bounds__({32 * WARPS_PER_BLOCK}, {min_blocks})")


def kernel_declaration_header(attributes: str) -> str:
    """Header text after which MLX's `__global__` kernel declaration carries `attributes` (none:
    CUDA's own definition back), under a CUDA compiler only (launch_bounds_header's why)."""
    return f"""
// The kernel MLX declares after this header: __global__ with {attributes or 'no attributes'}.
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#undef __global__
#define __global__ __location__(global){' ' + attributes if attributes else ''}
#endif
"""


@lru_cache(maxsize=None)
def absent_input(dtype) -> mx.array:
    """A one-element stand-in for a kernel input the launch does not have (an absent sink,
    outliers, retained slots): the kernels read none of it, their meta or template says so.
    One per dtype, made once (not an allocation per decode step)."""
    return mx.zeros((1,), dtype=dtype)


def check_skip(skip: int, n_valid: int, label: str) -> None:
    """Leading history tokens a partials kernel ignores (read exactly elsewhere, e.g. the
    attention sink): the kernels keep every tile non-empty only for skips inside the first
    tile. `label` names the kernel in the error."""
    if not 0 <= skip < min(n_valid, TILE):
        raise QuantizerConfigError(
            f"{label}: skip={skip} leading tokens of {n_valid}; allowed is 0 <= skip < "
            f"min(history, {TILE})"
        )


def _sink_inputs(sink, queries, window_keys, window_values, value_dim: int):
    """(sk, sv, n_sink) for the partials kernel: the sink in the queries' dtype (the kernel
    reads it through the window's pointer type; astype is free when the dtypes agree, as they
    do for a model's caches), or dummies and 0."""
    dtype = queries.dtype
    if sink is None:
        return absent_input(dtype), absent_input(dtype), 0
    keys, values = sink
    B, H, _, D = window_keys.shape
    S = keys.shape[2] if keys.ndim == 4 else 0
    if S < 1 or keys.shape != (B, H, S, D) or values.shape != (B, H, S, value_dim):
        raise QuantizerConfigError(
            f"fused decode: sink keys {keys.shape} / values {values.shape} do not fit the window "
            f"{window_keys.shape} / {window_values.shape}; allowed are (B, H, S, D) / (B, H, S, DV) "
            f"= ({B}, {H}, S, {D}) / ({B}, {H}, S, {value_dim}) with S >= 1"
        )
    return keys.astype(dtype), values.astype(dtype), S


def merge_partials(part_o, part_m, part_l, queries):
    """Kernel 2: the blocks' partials (BH, n_blocks, R, DV) -> the output row per query head,
    (B, Hq, 1, DV) in the queries' dtype. Serves every partials kernel of this shape (also
    fused_decode_rotated's)."""
    B, n_q_heads = queries.shape[:2]
    BH, _, R, DV = part_o.shape
    dtype = queries.dtype
    (out,) = _kernels()[1](
        inputs=[part_o, part_m, part_l],
        template=[("DV", DV), ("MAX_BLOCKS", partials_merge_source.MAX_BLOCKS), ("QT", dtype)],
        grid=(DV, BH * R, 1),
        threadgroup=(DV, 1, 1),
        output_shapes=[(B, n_q_heads, 1, DV)],
        output_dtypes=[dtype],
    )
    return out
