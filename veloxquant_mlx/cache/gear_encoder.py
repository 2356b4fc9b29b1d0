"""GEAR's encoder (see gear.py for the method and its deviations), in compiled stages.

The stages run through mx.compile, around what cannot fuse (reductions, the argpartition,
mx.quantize / mx.dequantize, the matmuls): the elementwise runs between them, many of them on one
column of every block (the low rank's Gram-Schmidt), become single kernels. For one 2048-token
chunk of one layer (8 KV heads x 128, K and V) the encoder's lazy graph shrinks from 440
non-view nodes to 292 (376 with the power iteration left uncompiled, as on CUDA: see
gear_lowrank.COMPILE_ON_GPU; 188 there with gear_encode_kernel's kernels, which do the power
iteration's Gram-Schmidt steps between its sums and the sparse part; 88 since session 17, with
gear_power_kernel.py's one launch per side for the whole power iteration); counted by `python -m
tests.cache.bench_encoders` / `bench_gear_encode` on the CPU, where mx.dequantize is itself built
from elementwise ops. CPU time hardly moves (1.02-1.06x; the
argpartition and mx.quantize dominate there); on a GPU fewer launches should matter more, not
yet measured. Every reduction, argpartition, scatter, quantize and matmul is the same op on the
same array as in the uncompiled encoder, so the stored arrays are bit-identical (checked
against the encoder of main 2e28496 by tests/cache/test_encoder_identity.py). On CUDA the
argpartition is replaced by outlier_select_kernel.py (MLX's CUDA argpartition sorts whole rows):
the same outliers wherever the count-th score is not tied, stored in ascending score order
(tests/cache/test_gear_encode_kernel.py compares under that rule: tests/cache/stable_selection.py).
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import mlx.core as mx

from veloxquant_mlx.cache import gear_encode_kernel, gear_group_kernel, outlier_select_kernel
from veloxquant_mlx.cache.gear_lowrank import kernel_factors, low_rank_factors, takes_power_kernel
from veloxquant_mlx.cache.gear_outliers import index_dtype, outlier_mask, outlier_scores, select_outliers


class EncoderSetting(NamedTuple):
    bits: int
    group: int
    rank: int
    outliers: int  # per block of `block_tokens` x dim entries; 0: no sparse part
    block_tokens: int
    side_dtype: mx.Dtype
    per_channel: bool  # keys: groups along tokens; values: along the head dim


def encode_side(setting: EncoderSetting, blocks: mx.array, centres: mx.array | None = None) -> dict[str, mx.array]:
    """blocks (B, H, n_blocks, block_tokens, d) float32 -> GEAR's arrays for them, by name
    without the side prefix ("codes", "scales", "zeros", "lr_tokens", "lr_channels",
    "out_values", "out_index"); `centres`: what outlier distances are measured from, None for
    each entry's group mean."""
    return encode_sides([(setting, blocks, centres)])[0]


# False: each side's selection and power iteration launched apart, as before session 42 (an
# A/B on the GPU: prefill_chunks --alternate gear_encoder.PAIR_SIDES=0).
PAIR_SIDES = True


class _Launch(NamedTuple):
    """A step of a side's encode that one launch may run for two sides (paired_rows): the
    outlier selection ("select": the scores, the count) or the power iteration ("power": the
    residual, the rank, the factors' dtype)."""
    kind: str
    array: mx.array
    size: int
    dtype: mx.Dtype = mx.float32


def encode_sides(sides: list[tuple[EncoderSetting, mx.array, mx.array | None]]) -> list[dict[str, mx.array]]:
    """encode_side of each (setting, blocks, centres), the sides' encodes run step by step
    together so that two sides' outlier selections, and their power iterations, of one shape run
    as one launch (outlier_select_kernel.smallest_pair, gear_power_kernel.factors_pair: half the
    launches' time where one side's blocks leave most SMs idle). Each side's arrays are what
    encode_side computes for it alone, bit for bit."""
    steps = [_encode_steps(*side) for side in sides]
    results: list = [None] * len(steps)
    answers: dict[int, object] = {i: None for i in range(len(steps))}
    while answers:
        launches = {}
        for i, answer in answers.items():
            try:
                launches[i] = steps[i].send(answer)
            except StopIteration as done:
                results[i] = done.value
        answers = _run_launches(launches)
    return results


def _run_launches(launches: dict[int, _Launch]) -> dict[int, object]:
    """Each side's launch run, two of the same kind and shape as one."""
    answers = {}
    groups: dict[tuple, list[int]] = {}
    for i, launch in launches.items():
        groups.setdefault((launch.kind, launch.array.shape[-2:], launch.size, launch.dtype), []).append(i)
    take = 2 if PAIR_SIDES else 1
    for (kind, _, size, dtype), members in groups.items():
        while members:
            pair, members = members[:take], members[take:]
            arrays = [launches[i].array for i in pair]
            if kind == "select":
                # In ascending position, the order GEAR stores them in (no sort after).
                picks = (outlier_select_kernel.smallest_pair(*arrays, size, by_position=True) if len(pair) == 2
                         else [outlier_select_kernel.smallest(arrays[0], size, by_position=True)])
            else:
                picks = kernel_factors(arrays, size, dtype)
            answers.update(zip(pair, picks))
    return answers


def _encode_steps(setting: EncoderSetting, blocks: mx.array, centres: mx.array | None):
    """encode_side as a generator: it yields a _Launch where the selection or the power
    iteration runs as a kernel that pairs (encode_sides runs it and sends the result back) and
    returns the side's arrays."""
    with_centres = centres is not None
    centre_args = [centres] if with_centres else []
    # On CUDA the outliers are picked by outlier_select_kernel.py (no sort) between the scores'
    # and the quantizing stage; elsewhere stage 1 picks them with argpartition.
    picks = []
    grouped = gear_group_kernel.applies(blocks.shape, setting.group, setting.per_channel)
    if setting.outliers and outlier_select_kernel.applies(blocks.shape[-2] * blocks.shape[-1], setting.outliers):
        if grouped and not with_centres:
            scores = gear_group_kernel.scores(blocks, setting.group, setting.per_channel)
        else:
            scores = _compiled_scores(setting, with_centres)(blocks, *centre_args)
        picks = [(yield _Launch("select", scores, setting.outliers))]
        centre_args = []
    if picks and grouped:
        # On CUDA the holes' fill, the cast and the keys' transpose are one kernel per side, and
        # Q(D) with the residual another after mx.quantize; the picks are the stored index
        # as they are (uint32: the sparse part casts them).
        dense_parts = _grouped_quantize(setting, blocks, picks[0])
    else:
        dense_parts = _compiled_quantize(setting, with_centres and not picks, bool(picks))(blocks, *centre_args, *picks)
    codes, scales, zeros, approx, *rest = dense_parts
    out = {"codes": codes, "scales": scales, "zeros": zeros}
    # On CUDA the sparse part is one kernel that also adds the low rank at the outliers only
    # (gear_encode_kernel.sparse_part): stage 2 then returns A B^T instead of Q(D) + A B^T.
    # With the power-iteration kernel (whose factors are not the ops' bits anyway) the sparse
    # kernel computes A B^T at each outlier from the stored factors itself, in the order
    # gear_prefill_kernel.py adds it back: no (n, d) float32 product, no matmul.
    sparse_kernel = bool(setting.outliers) and gear_encode_kernel.enabled()
    n_tokens, d = blocks.shape[-2:]
    low_at_outliers = sparse_kernel and bool(setting.rank) and takes_power_kernel(n_tokens, d, setting.rank)
    low = factors = None
    if setting.rank:
        residual = rest[0]
        if low_at_outliers:
            # The kernel writes the factors in the side dtype, as stored (no cast launch after).
            tokens, channels = yield _Launch("power", residual, setting.rank, setting.side_dtype)
            B, H, n_blocks, nb, _ = tokens.shape
            out["lr_tokens"], out["lr_channels"] = factors = tokens.reshape(B, H, n_blocks * nb, setting.rank), channels
        else:
            if takes_power_kernel(n_tokens, d, setting.rank):
                tokens, channels = yield _Launch("power", residual, setting.rank)
            else:
                tokens, channels = low_rank_factors(residual, setting.rank)
            parts = _compiled_low_rank_parts(setting, add_to_approx=not sparse_kernel)
            out["lr_tokens"], out["lr_channels"], fitted = parts(tokens, channels, approx)
            if sparse_kernel:
                low = fitted
            else:
                approx = fitted
    if setting.outliers:
        # A block's entries in ascending index (token-major): the decode kernel's tiles then
        # read only their own run of them (fused_decode_gear.SORTED_SCAN). The sums over them
        # do not depend on the order. The selection kernel's picks come in that order already.
        index = rest[-1] if picks else mx.sort(rest[-1], axis=-1)
        if sparse_kernel:
            out["out_values"], out["out_index"] = gear_encode_kernel.sparse_part(
                blocks, approx, low, index, setting.side_dtype, index_dtype(n_tokens * d), factors=factors
            )
        else:
            out["out_values"], out["out_index"] = _compiled_sparse_part(setting)(blocks, approx, index)
    return out


@lru_cache(maxsize=None)
def _compiled_scores(setting: EncoderSetting, with_centres: bool):
    """The outliers' scores (gear_outliers.outlier_scores) for outlier_select_kernel.py."""

    def scores(blocks: mx.array, centres: mx.array | None = None):
        if centres is None:
            centres = group_means(blocks, setting.group, setting.per_channel)
        return outlier_scores(blocks, centres)

    return mx.compile(scores)


@lru_cache(maxsize=None)
def _compiled_quantize(setting: EncoderSetting, with_centres: bool, with_picks: bool = False):
    """Stage 1: outliers out (holes filled with the mean of the rest of their group), Q(D)
    with mx.quantize, its dequantized value and the residual D - Q(D) the low rank fits.
    `with_picks`: the outliers' positions are given (outlier_select_kernel.smallest), not
    selected here."""
    g, count, side = setting.group, setting.outliers, setting.side_dtype

    def quantize(blocks: mx.array, *given: mx.array):
        B, H, n_blocks, nb, d = blocks.shape
        n = n_blocks * nb
        dense, index = blocks, []
        if count:
            if with_picks:
                selected, mask = given[-1].astype(mx.int32), outlier_mask(given[-1], blocks.shape)
            else:
                centres = given[0] if with_centres else group_means(blocks, g, setting.per_channel)
                selected, mask = select_outliers(blocks, centres, count)
            index = [selected]
            # Fill the holes with the mean of the rest of their group: inside its range, so a
            # removed outlier no longer widens the group's scale.
            fill = group_means(blocks, g, setting.per_channel, weights=(~mask).astype(mx.float32))
            dense = mx.where(mask, fill, blocks)
        dense = dense.reshape(B, H, n, d).astype(side)
        return (*quantized(setting, dense.swapaxes(-1, -2) if setting.per_channel else dense, blocks.shape), *index)

    return mx.compile(quantize)


def _grouped_quantize(setting: EncoderSetting, blocks: mx.array, picks: mx.array) -> tuple:
    """Stage 1 through gear_group_kernel.py (CUDA): _compiled_quantize's outputs, bit for bit on
    the CPU emulation, from the blocks and the picks."""
    g, bits = setting.group, setting.bits
    dense = gear_group_kernel.dense(blocks, picks, g, setting.per_channel, setting.side_dtype)
    codes, scales, zeros = mx.quantize(dense, group_size=g, bits=bits)
    approx, residual = gear_group_kernel.approx_and_residual(dense, codes, scales, zeros, bits, g, setting.per_channel,
                                                             blocks.shape, with_residual=bool(setting.rank))
    return (_stored_codes(setting, codes, blocks.shape), scales, zeros, approx, *([residual] if setting.rank else []),
            picks)


def quantized(setting: EncoderSetting, rows: mx.array, blocks_shape: tuple) -> tuple:
    """The dense part in the side dtype, as mx.quantize takes it (keys (B, H, d, n): groups along
    tokens; values (B, H, n, d)) -> codes, scales, zeros, Q(D) as blocks_shape float32, and the
    residual D - Q(D) the low rank fits (not computed without one)."""
    bits, g = setting.bits, setting.group
    codes, scales, zeros = mx.quantize(rows, group_size=g, bits=bits)
    approx = dequantize(codes, scales, zeros, g, bits)
    if setting.per_channel:
        approx, rows = approx.swapaxes(-1, -2), rows.swapaxes(-1, -2)
    approx = approx.reshape(blocks_shape)
    residual = [rows.astype(mx.float32).reshape(blocks_shape) - approx] if setting.rank else []
    return (_stored_codes(setting, codes, blocks_shape), scales, zeros, approx, *residual)


def _stored_codes(setting: EncoderSetting, codes: mx.array, blocks_shape: tuple) -> mx.array:
    """mx.quantize's codes as the store keeps them: keys' (B, H, d, words) split into 32-token
    runs of `bits` words (B, H, d, n / 32, bits); values' as they are."""
    if not setting.per_channel:
        return codes
    B, H, n_blocks, nb, d = blocks_shape
    return codes.reshape(B, H, d, n_blocks * nb // 32, setting.bits)


@lru_cache(maxsize=None)
def _compiled_low_rank_parts(setting: EncoderSetting, add_to_approx: bool = True):
    """Stage 2 (after low_rank_factors): the factors as stored and Q(D) + A B^T (A B^T alone
    when not `add_to_approx`: the CUDA sparse kernel adds it at the outliers)."""
    side = setting.side_dtype

    def parts(tokens: mx.array, channels: mx.array, approx: mx.array):
        tokens, channels = tokens.astype(side), channels.astype(side)
        B, H, n_blocks, nb, _ = approx.shape
        low = tokens.astype(mx.float32) @ channels.astype(mx.float32).swapaxes(-1, -2)
        fitted = approx + low if add_to_approx else low
        return tokens.reshape(B, H, n_blocks * nb, setting.rank), channels, fitted

    return mx.compile(parts)


@lru_cache(maxsize=None)
def _compiled_sparse_part(setting: EncoderSetting):
    """Stage 3: the corrections that make Q(D) + A B^T + S return each outlier's entry."""

    def sparse(blocks: mx.array, approx: mx.array, index: mx.array):
        B, H, n_blocks, nb, d = blocks.shape
        missing = (blocks - approx).reshape(B, H, n_blocks, nb * d)
        values = mx.take_along_axis(missing, index, axis=-1).astype(setting.side_dtype)
        return values, index.astype(index_dtype(nb * d))

    return mx.compile(sparse)


def group_means(blocks: mx.array, group: int, per_channel: bool, weights=None) -> mx.array:
    """Each entry of blocks (..., nb, d) replaced by its quantization group's mean (over the
    `weights`-selected entries if given): groups of `group` tokens per channel (keys) or of
    `group` channels per token (values)."""
    *lead, nb, d = blocks.shape
    shape = (*lead, nb // group, group, d) if per_channel else (*lead, nb, d // group, group)
    axis = -2 if per_channel else -1
    x = blocks.reshape(shape)
    if weights is None:
        mean = mx.mean(x, axis=axis, keepdims=True)
    else:
        w = weights.reshape(shape)
        mean = mx.sum(x * w, axis=axis, keepdims=True) / mx.maximum(mx.sum(w, axis=axis, keepdims=True), 1)
    return mx.broadcast_to(mean, shape).reshape(blocks.shape)


def dequantize(codes, scales, zeros, group: int, bits: int) -> mx.array:
    # float32 scales: w * s + z computed exactly as quantized_matmul does, not rounded to fp16.
    return mx.dequantize(codes, scales.astype(mx.float32), zeros.astype(mx.float32), group_size=group, bits=bits)
