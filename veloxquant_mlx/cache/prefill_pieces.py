"""The order of a prefill's piecewise history decode (turboquant_rvq's portable path; gear orders
its own pieces through mx.depends since session 6, see cache/gear.py).

Each decodes a prefill chunk's history in fixed-size pieces into one preallocated result, so
that the float32 temporaries of one piece only exist at a time. The pieces do not depend on
each other, so MLX may compute every piece's ops side by side and hold all their temporaries
at once unless something orders them. Two ways to order them:

- SYNC = 1 (default): evaluate the result after each piece, before the next is built
  (sessions 3-4's way). A host sync per piece: on a GPU each drains the queue; at a 16K
  history turboquant_rvq makes 8 per layer and prefill chunk (plus the queries' evaluation).
- SYNC = 0: each piece's inputs depend on the previous piece's decoded output (`mx.depends`):
  an order inside the graph, no host sync, but a looser bound.

Measured on the CPU (session 5; one turboquant_rvq-4 layer, 8 kv heads x 128, bf16, 16K
history; peak memory the prefill K/V build adds, bit-identical results): one lazy graph 784
MiB, pieces chained 252 MiB, pieces synced 187 MiB (the result itself is 64 MiB); build and
evaluation 1.3-1.8 s either way on the loaded 2-core machine. Chained, the transient still
grows with the history (tests/cache/test_turboquant_rvq_prefill_peak.py's bounds fail: 20 MiB
at 2K, 39 at 8K), so synced stays the default. What the syncs cost on a GPU is unmeasured:
`VELOXQUANT_CUDA_KERNELS=0 python -m veloxquant_mlx.bench.kernel_probe --parts prefill --methods turboquant_rvq`
(on CUDA turboquant_rvq's history is built by one kernel since session 6: turboquant_prefill_kernel.py)
with and without `--set prefill_pieces.SYNC=0` compares the two.
"""

from __future__ import annotations

import mlx.core as mx

SYNC = 1


def piece_tokens(budget_bytes: int, bytes_per_token: int, block: int) -> int:
    """Tokens per piece: whole blocks of `block` tokens whose float32 history fits
    `budget_bytes` at `bytes_per_token` (at least one block)."""
    return max(1, budget_bytes // bytes_per_token // block) * block


def chained(inputs, previous) -> list:
    """A piece's input arrays, made to wait for `previous` (the previous piece's decoded output;
    None for the first piece) unless pieces are synced instead."""
    if previous is None or SYNC:
        return list(inputs)
    return list(mx.depends(list(inputs), [previous]))


def settle(result: mx.array) -> None:
    """After a piece is written into `result`: evaluate it where pieces are synced."""
    if SYNC:
        mx.eval(result)
