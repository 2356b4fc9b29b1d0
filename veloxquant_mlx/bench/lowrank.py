"""Cost and error of GEAR's low-rank residual: our power iteration against `mx.linalg.svd`.

    python -m veloxquant_mlx.bench.lowrank --rank 4 --out results/x.json

GEAR (Kang et al. 2024) approximates each block's quantization residual by a rank-r product;
the paper uses power iteration, which veloxquant_mlx.cache.gear_lowrank implements
(`low_rank_factors`). This times it against the exact truncated SVD on the same Gaussian
residuals of one side of one layer: by default a 4096-token prompt of SmolLM2's shape (3 heads
x 16 blocks of 256 tokens x head_dim 64). Reported per method: the relative Frobenius error
||R - A B|| / ||R|| and the seconds per call (median and spread over interleaved rounds;
mx.linalg.svd runs on the CPU stream, the only one MLX implements it on).
"""

from __future__ import annotations

import sys

MODULE = "veloxquant_mlx.bench.lowrank"


def parse_args(argv=None):
    from veloxquant_mlx.bench.command import parser, positive

    p = parser(MODULE, __doc__)
    p.add_argument("--rank", type=positive, default=4)
    p.add_argument("--heads", type=positive, default=3)
    p.add_argument("--blocks", type=positive, default=16)
    p.add_argument("--block-tokens", type=positive, default=256)
    p.add_argument("--head-dim", type=positive, default=64)
    p.add_argument("--rounds", type=positive, default=5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.rank > min(args.block_tokens, args.head_dim):
        p.error(f"--rank {args.rank} is invalid: allowed is 1..min(--block-tokens, --head-dim) "
                f"= {min(args.block_tokens, args.head_dim)}")
    return args


def run(args) -> dict:
    import mlx.core as mx

    from veloxquant_mlx.bench.command import result
    from veloxquant_mlx.bench.timing import summarize, time_calls
    from veloxquant_mlx.cache.gear_lowrank import low_rank_factors

    residual = mx.random.normal((1, args.heads, args.blocks, args.block_tokens, args.head_dim),
                                key=mx.random.key(args.seed))
    mx.eval(residual)
    r = args.rank

    def power_iteration():
        a, b = low_rank_factors(residual, r)
        return a, b.swapaxes(-1, -2)

    def svd():
        u, s, vt = mx.linalg.svd(residual, stream=mx.cpu)
        return u[..., :r] * s[..., None, :r], vt[..., :r, :]

    methods = {"power_iteration": power_iteration, "svd": svd}
    norm = mx.linalg.norm(residual.reshape(-1))
    rows = {}
    for name, fn in methods.items():
        a, b = fn()
        rows[name] = {"relative_error": (mx.linalg.norm((residual - a @ b).reshape(-1)) / norm).item()}
    seconds = time_calls(methods, rounds=args.rounds, warmup=1)
    for name, values in seconds.items():
        rows[name]["milliseconds"] = summarize(values, unit=1e-3)
    return result(args, rows, shape=list(residual.shape), data="Gaussian residuals N(0, 1)")


def main(argv=None) -> int:
    from veloxquant_mlx.bench.command import run_module

    return run_module(MODULE, parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
