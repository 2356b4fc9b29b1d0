"""GEAR on the real model: the DESIGN.md quality protocol (SmolLM2-135M-Instruct in float32 on
the CPU, 512 tokens of Pride and Prejudice, prefill 128, decode 384 teacher-forced), against an
unquantized KVCache, with mlx-lm's QuantizedKVCache at 2 and 4 bits in the same run.

Run (needs veloxquant_mlx.quality and veloxquant_mlx.models):
  LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
    /work/venv/bin/python benchmarks/gear_quality.py --out results/gear_quality.json

Besides the protocol's mean KL over all 384 decoded positions we report it over the positions
that read a compressed history: GEAR encodes whole blocks of 256 tokens, so positions before
256 still see every token exactly (the exact window), which flatters the all-position mean.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shlex
import time

import mlx.core as mx
from mlx_lm.models.cache import QuantizedKVCache

from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.gear import BLOCK_TOKENS, GEARCache
from veloxquant_mlx.integration.dispatch import install, module_names_of
from veloxquant_mlx.models import load_model
from veloxquant_mlx.quality import N_PREFILL, passage_tokens, reference_run, teacher_forced_run


class MagnitudeGEAR(GEARCache):
    """Outliers by largest |x| (the paper's literal filter), for comparison."""

    def _selection_centres(self, blocks, per_channel):
        return mx.zeros_like(blocks)


class SmallBlockGEAR(GEARCache):
    """64-token blocks: the history is compressed from position 64 on (costs more bytes: the
    per-block factor B and the outlier indices amortize over fewer tokens)."""

    block_tokens = 64


def compare(ref, run, tokens, first_row):
    targets = mx.array(list(tokens[1:]), dtype=mx.int32)[:, None]
    d = slice(first_row, None)
    ref_lp, q_lp = ref.logprobs[d], run.logprobs[d]
    kl = mx.maximum(mx.sum(mx.exp(ref_lp) * (ref_lp - q_lp), axis=-1), 0)
    agree = mx.argmax(ref_lp, axis=-1) == mx.argmax(q_lp, axis=-1)
    nll = -mx.take_along_axis(run.logprobs, targets, axis=-1)[N_PREFILL - 1 :].mean()
    return kl.mean().item(), agree.astype(mx.float32).mean().item(), math.exp(nll.item())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="results/gear_quality.json")
    ap.add_argument("--only", default="", help="comma-separated subset of the cache names")
    args = ap.parse_args()
    model, tokenizer = load_model()
    # The integration's dispatcher: our caches attend over their compressed form, mlx-lm's
    # caches (the reference, QuantizedKVCache) go to mlx-lm's attention untouched.
    install(module_names_of([layer.self_attn for layer in model.layers]))
    tokens = passage_tokens(tokenizer, 512)
    n_layers = len(model.layers)

    def gear(cls=GEARCache, **fields):
        return lambda m: [cls(KVCacheConfig(method="gear", **fields), i, n_layers) for i in range(n_layers)]

    candidates = {  # in order of importance: a run cut short keeps the first ones
        "gear-2 (default: r4, 1% outliers)": gear(),
        "QuantizedKVCache-2 g32": lambda m: [QuantizedKVCache(group_size=32, bits=2) for _ in m.layers],
        "QuantizedKVCache-4 g64": lambda m: [QuantizedKVCache(group_size=64, bits=4) for _ in m.layers],
        "gear-2 magnitude-selected outliers": gear(MagnitudeGEAR),
        "gear-2 rank 0": gear(gear_rank=0),
        "gear-2 no outliers": gear(gear_outlier_fraction=0.0),
        "gear-2 quant only": gear(gear_rank=0, gear_outlier_fraction=0.0),
        "gear-4": gear(gear_bits=4),
        "gear-2 64-token blocks (stress: more of the passage compressed)": gear(SmallBlockGEAR),
    }
    if args.only:
        keep = args.only.split(",")
        candidates = {k: v for k, v in candidates.items() if any(k.startswith(s) for s in keep)}

    start = time.perf_counter()
    ref = reference_run(model, tokens)
    rows = {}
    for name, make in candidates.items():
        t0 = time.perf_counter()
        run = teacher_forced_run(model, tokens, make(model), N_PREFILL)
        kl, top1, ppl = compare(ref, run, tokens, N_PREFILL - 1)
        kl_c, top1_c, _ = compare(ref, run, tokens, BLOCK_TOKENS)  # rows predicting 257.. read >= 256 compressed
        rows[name] = {
            "kl_mean_all_decoded": kl, "top1_all_decoded": top1, "ppl_decoded": ppl,
            "kl_mean_after_256": kl_c, "top1_after_256": top1_c,
            "nbytes_after_prompt": run.nbytes_after_prompt, "nbytes_after_run": run.nbytes_after_run,
            "seconds": time.perf_counter() - t0,
        }
        print(name, json.dumps(rows[name]), flush=True)
        write(args, ref, tokens, rows, start)  # after each cache: a long run keeps what it measured


def write(args, ref, tokens, rows, start):
    _, _, ppl_ref = compare(ref, ref, tokens, N_PREFILL - 1)
    result = {
        "command": "LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 "
        f"/work/venv/bin/python benchmarks/gear_quality.py --out {args.out}" + (f" --only {shlex.quote(args.only)}" if args.only else ""),
        "machine": f"{platform.machine()} CPU, MLX {mx.__version__} cpu backend, float32 model",
        "protocol": "SmolLM2-135M-Instruct (GGUF Q4_1 -> float32), 512 tokens of Pride and Prejudice, "
        "prefill 128, decode 384 teacher-forced; KL(ref || cache) of next-token distributions",
        "ppl_reference_decoded": ppl_ref,
        "caches": rows,
        "seconds_total": time.perf_counter() - start,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
