"""Quality of each cache spec by the DESIGN.md protocol, delegated to veloxquant_mlx.quality.

The passage, the prefill/decode split and the metrics (KL(ref || q), top-1 agreement, PPL
against an unquantized KVCache, teacher-forced) all live in `veloxquant_mlx.quality`; this
module only runs it for every spec, sharing one reference pass, and opens each spec so our
caches are read through the patched attention.
"""

from __future__ import annotations

import traceback

from veloxquant_mlx.bench.memory import fp16_bytes_for
from veloxquant_mlx.bench.progress import Progress, Step


def run_quality(model, tokenizer, specs, *, progress: bool = True) -> list[dict]:
    from veloxquant_mlx.quality import passage_tokens
    from veloxquant_mlx.quality.kv_quality import N_PREFILL, measure_kv_quality, reference_run

    tokens = passage_tokens(tokenizer)
    with Step(f"quality: reference pass ({len(tokens)} tokens, unquantized KVCache)", enabled=progress):
        reference = reference_run(model, tokens, N_PREFILL)
    rows = []
    with Progress(len(specs), "quality", enabled=progress) as bar:
        for spec in specs:
            bar.set_postfix_str(spec.name)
            row = {"spec": spec.name, "label": spec.label, "kind": spec.kind}
            try:
                with spec.open(model) as make_cache:
                    result = measure_kv_quality(model, tokens, lambda _m: make_cache(),
                                                N_PREFILL, reference=reference)
                row.update(result.to_dict())
                row["top1_agreement"] = row["top1"]
                # Bytes at the end of the run (n_tokens - 1 tokens held) against an fp16 cache
                # holding exactly those tokens: the x axis of the quality-against-bytes plot.
                held = row["n_tokens"] - 1
                row["fp16_bytes_after_run"] = fp16_bytes_for(model, held)
                row["bytes_ratio_vs_fp16"] = row["nbytes_after_run"] / row["fp16_bytes_after_run"]
            except Exception as exc:  # noqa: BLE001 - one failing spec must not end the run
                row["error"] = f"{type(exc).__name__}: {str(exc)[:600]}"
                row["traceback_tail"] = traceback.format_exc().splitlines()[-3:]
            rows.append(row)
            bar.update()
    return rows
