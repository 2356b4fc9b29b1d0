"""Two sides' rows in one launch: a kernel written for one array of rows (a CUDA block per row)
takes two: a block per row of the first array (`<name>_a`), then one per row of the second
(`<name>_b`).

Why: GEAR's outlier selection and power iteration run one CUDA block per 256 x 128 block of a
side, 64 per side of an 8 x 128 layer's 2048-token chunk, and a block's work is a chain of
passes over its row (latency-bound): a launch takes one block's time on 64 of the GPU's SMs
(132 on the H100 and H200) and leaves the rest idle, so the keys' launch and the values' one
each took that time (Nsight Compute on an H100: 35 and 47 us per launch, twice per chunk,
results/ncu_prefill_chunk_h100_s42.json). One launch of both sides' 128 blocks fills the SMs
once. Each block computes what it computed alone, so the results are the same bits.

A kernel's source reads its row through `vq_row` and each paired array through `vq_<name>`;
`prologue` defines them for the single or the paired build, `argument_names` gives the build's
input or output names. The paired build counts the first side's rows from its first input's
shape (MLX's `<input>_shape` parameter), not from a template constant: one compiled module
serves every chunk length (a constant would compile again for each row count met).
"""

from __future__ import annotations

import math


def prologue(paired_names: tuple[str, ...], paired: bool) -> str:
    """C++ defining `vq_row` (the block's row within its side's array) and, per name of
    `paired_names`, `vq_<name>` (that array: the kernel's own, or its side's of the pair). The
    paired build's template constant LEAD (`lead_axes`) is the number of leading axes of the
    first paired input that count its rows."""
    first = paired_names[0]
    if paired:
        lines = ["size_t vq_rows_a = 1;",
                 f"for (int i = 0; i < LEAD; ++i) vq_rows_a *= {first}_a_shape[i];",
                 "const bool vq_first = blockIdx.x < vq_rows_a;",
                 "const size_t vq_row = vq_first ? (size_t)blockIdx.x : (size_t)blockIdx.x - vq_rows_a;"]
        lines += [f"auto* const vq_{name} = vq_first ? {name}_a : {name}_b;" for name in paired_names]
    else:
        lines = ["const size_t vq_row = blockIdx.x;"]
        lines += [f"auto* const vq_{name} = {name};" for name in paired_names]
    return "".join(f"  {line}\n" for line in lines)


def argument_names(names: list[str], paired_names: tuple[str, ...], paired: bool) -> list[str]:
    """The kernel's input (or output) names: each of `paired_names` as `<name>_a`, `<name>_b`
    in the paired build."""
    if not paired:
        return list(names)
    return [part for name in names for part in ((f"{name}_a", f"{name}_b") if name in paired_names else (name,))]


def lead_axes(sides: list, row_axes: int) -> list[tuple[str, int]]:
    """A launch's template entries for `sides` (one or two arrays of rows with `row_axes`
    trailing axes each): for a pair LEAD, the leading axes of the first array that count its
    rows; for one side none."""
    return [("LEAD", sides[0].ndim - row_axes)] if len(sides) == 2 else []


def total_rows(sides: list, row_axes: int) -> int:
    """The CUDA blocks of a launch over `sides`: every side's rows (the product of each array's
    leading axes)."""
    return sum(math.prod(side.shape[:-row_axes]) for side in sides)
