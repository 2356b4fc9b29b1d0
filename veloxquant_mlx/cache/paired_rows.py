"""Two sides' rows in one launch: a kernel written for one array of rows (a CUDA block per row)
takes two, its first RA blocks reading and writing `<name>_a`, the rest `<name>_b`.

Why: GEAR's outlier selection and power iteration run one CUDA block per 256 x 128 block of a
side, 64 per side of an 8 x 128 layer's 2048-token chunk, and a block's work is a chain of
passes over its row (latency-bound): a launch takes one block's time on 64 of the GPU's SMs
(132 on the H100 and H200) and leaves the rest idle, so the keys' launch and the values' one
each took that time (Nsight Compute on an H100: 35 and 47 us per launch, twice per chunk,
results/ncu_prefill_chunk_h100_s42.json). One launch of both sides' 128 blocks fills the SMs
once. Each block computes what it computed alone, so the results are the same bits.

A kernel's source reads its row through `vq_row` and each paired array through `vq_<name>`;
`prologue` defines them for the single or the paired build, `argument_names` gives the build's
input or output names.
"""

from __future__ import annotations


def prologue(paired_names: tuple[str, ...], paired: bool) -> str:
    """C++ defining `vq_row` (the block's row within its side's array) and, per name of
    `paired_names`, `vq_<name>` (that array: the kernel's own, or its side's of the pair; the
    template constant RA is the first side's row count)."""
    if paired:
        lines = ["const bool vq_first = blockIdx.x < RA;",
                 "const size_t vq_row = vq_first ? (size_t)blockIdx.x : (size_t)blockIdx.x - RA;"]
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

