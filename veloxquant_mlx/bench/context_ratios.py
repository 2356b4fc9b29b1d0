"""Each cache's speed against the fp16 KVCache's of the same run, over context, from several
`bench.gpu_speed` files: a JSON table and a two-panel PNG (decode, prefill).

    python -m veloxquant_mlx.bench.context_ratios results/gpu_speed_h200_s4_short.json \\
        results/gpu_speed_h200_s6_32k_a.json results/gpu_speed_h200_s6_32k_b.json \\
        results/gpu_speed_h200_s6_64k.json results/gpu_speed_h200_s5_128k.json \\
        --out results/h200_context_ratios.json          # and h200_context_ratios.png beside it

Why its own module: the H200's figures at different contexts come from different sessions and
machines, on which fp16 itself decoded anywhere from 381 to 655 tok/s at 32K; tokens/s across
runs mislead, a ratio to fp16 of the same run does not (as much). Every ratio here is taken
inside one file, from its raw runs through gpu_speed_figures (the figures `gpu_speed` itself now
reports; older files summarised prefill by the median, which mixes the first repeat's JIT compiles
with warm repeats):
  - decode: the median over repeats of each repeat's median interval, against fp16's (an
    `--interleave` file: the median of the per-round ratios to fp16);
  - prefill: the fastest repeat's seconds, against fp16's fastest (the first repeat of each spec
    at a new context pays the compiles of its shapes).
Where two files hold the same (spec, context), the later file on the command line wins, but a
prefill of one cold repeat (spec or fp16; its compiles included) never replaces a warm one (at
least two repeats each): the decode ratio can come from a newer file than the prefill ratio.
The table says which file each ratio comes from and how many repeats it had.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from veloxquant_mlx.bench.gpu_speed_figures import case_figure, paired_ratios

TARGET_LINES = {"decode": ((32768, 0.9), (131072, 1.0)), "prefill": ((32768, 1.2),)}
# A panel's y-axis ends at this many times its highest warm point (at least AXIS_FLOOR): a cold
# prefill of the first context in a process (every kernel's JIT compile: 11-31x fp16's at 4K in
# session 24's run) would otherwise flatten every warm point; points above are drawn at the edge
# with their value written beside them.
AXIS_HEADROOM, AXIS_FLOOR = 1.3, 2.0


def ratios_of_file(result: dict, source: str) -> dict[tuple[str, int], dict]:
    """(spec, context) -> its decode and prefill ratios to fp16 in this one file, from
    gpu_speed_figures' figures of the raw runs (specs whose fp16 case at that context has no
    finished run are left out). Interleaved files give the paired per-round decode ratio."""
    cases = {}
    for case in result.get("cases", []):
        figure = case_figure(case)
        if figure["decode_tps"] and figure["prefill_s"]:
            cases[(case["spec"], case["context"])] = (case, figure)
    out = {}
    for (spec, context), (case, figure) in cases.items():
        if spec == "fp16" or ("fp16", context) not in cases:
            continue
        fp16_case, fp16 = cases[("fp16", context)]
        paired = paired_ratios(case, fp16_case)
        out[(spec, context)] = {
            "spec": spec, "context": context, "source": source,
            "repeats": len(figure["prefill_repeats_s"]), "fp16_repeats": len(fp16["prefill_repeats_s"]),
            "decode_tps": figure["decode_tps"], "fp16_decode_tps": fp16["decode_tps"],
            "decode_vs_fp16": statistics.median(paired) if paired else figure["decode_tps"] / fp16["decode_tps"],
            "decode_ratio_basis": "paired interleaved rounds" if paired else "decode figures (median of repeats)",
            "prefill_s": figure["prefill_s"], "fp16_prefill_s": fp16["prefill_s"],
            "prefill_time_vs_fp16": figure["prefill_s"] / fp16["prefill_s"],
            "prefill_source": source,
            "prefill_warm": len(figure["prefill_repeats_s"]) >= 2 and len(fp16["prefill_repeats_s"]) >= 2,
        }
    return out


# What a row's prefill ratio is made of: kept together when an older file's warm prefill stays.
PREFILL_FIELDS = ("prefill_s", "fp16_prefill_s", "prefill_time_vs_fp16", "prefill_source", "prefill_warm")


def collect(paths: list[str]) -> list[dict]:
    """Rows of every file, the later file winning a (spec, context) both hold; its prefill only
    where it is warm or the earlier one was not."""
    merged: dict[tuple[str, int], dict] = {}
    for path in paths:
        try:
            result = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise SystemExit(f"context_ratios: cannot read {path}: {exc}") from None
        if "cases" not in result:
            raise SystemExit(f"context_ratios: {path} is not a bench.gpu_speed result (no 'cases')")
        for key, row in ratios_of_file(result, path).items():
            earlier = merged.get(key)
            if earlier is not None and earlier["prefill_warm"] and not row["prefill_warm"]:
                row.update({field: earlier[field] for field in PREFILL_FIELDS})
            merged[key] = row
    return sorted(merged.values(), key=lambda row: (row["spec"], row["context"]))


def _warm(row: dict, panel: str) -> bool:
    if panel == "prefill":
        return row["prefill_warm"]
    return row["repeats"] >= 2 and row["fp16_repeats"] >= 2 or row["decode_ratio_basis"] == "paired interleaved rounds"


def axis_top(warm_values: list[float]) -> float:
    """Where a panel's y-axis ends: AXIS_HEADROOM above its highest warm point, AXIS_FLOOR at least."""
    return max([AXIS_FLOOR, *(AXIS_HEADROOM * v for v in warm_values)])


def plot(rows: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    panels = (("decode_vs_fp16", "decode tokens/s vs fp16 (same run)", "decode"),
              ("prefill_time_vs_fp16", "prefill time vs fp16 (same run, fastest repeat)", "prefill"))
    for ax, (key, title, target) in zip(axes, panels):
        top = axis_top([row[key] for row in rows if _warm(row, target)])
        clipped: dict[int, int] = {}
        for spec in sorted({row["spec"] for row in rows}):
            mine = [row for row in rows if row["spec"] == spec]
            # Filled and joined: a warm figure (prefill: two repeats or more of the spec and of
            # fp16; decode: that, or paired interleaved rounds); hollow and not joined: one cold
            # repeat (its prefill includes the context's JIT compiles, its decode is one median
            # of tokens), which a line through it would make read like a trend.
            warm = [_warm(row, target) for row in mine]
            (line,) = ax.plot([r["context"] for r, w in zip(mine, warm) if w],
                              [r[key] for r, w in zip(mine, warm) if w], label=spec)
            for row, is_warm in zip(mine, warm):
                y = min(row[key], top)
                ax.plot([row["context"]], [y], marker="^" if y < row[key] else "o", color=line.get_color(),
                        markerfacecolor=line.get_color() if is_warm else "none")
                if y < row[key]:
                    # One label under another where several points at a context are above.
                    n = clipped[row["context"]] = clipped.get(row["context"], 0) + 1
                    ax.annotate(f"{spec} {row[key]:.1f}x", (row["context"], y), textcoords="offset points",
                                xytext=(6, -4 - 9 * (n - 1)), fontsize=7, color=line.get_color())
        ax.set_ylim(top=top * 1.04)
        ax.axhline(1.0, color="black", linewidth=0.8)
        for context, level in TARGET_LINES[target]:
            ax.plot([context], [level], marker="_", markersize=30, color="red")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("H200, 8B-shaped llama (8 layers, bf16); red marks: issue 5's targets; hollow, not joined: one cold "
                 "repeat (decode: not interleaved); triangle: above the axis, value beside it", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m veloxquant_mlx.bench.context_ratios",
                                description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", metavar="RESULT.json", help="bench.gpu_speed result files, oldest first")
    p.add_argument("--out", required=True, help="the JSON table; the PNG goes beside it (same stem)")
    p.add_argument("--no-plot", action="store_true", help="write the JSON only")
    args = p.parse_args(argv)
    rows = collect(args.files)
    if not rows:
        p.error("no (spec, context) with both the spec's and fp16's finished runs in " + ", ".join(args.files))
    out = Path(args.out)
    out.write_text(json.dumps({"command": "python -m veloxquant_mlx.bench.context_ratios " + " ".join(argv or sys.argv[1:]),
                               "rows": rows}, indent=1) + "\n")
    print(f"{'spec':<16} {'context':>7}  decode vs fp16  prefill vs fp16  repeats  source (prefill's if other)")
    for row in rows:
        prefill_from = "" if row["prefill_source"] == row["source"] else f" (prefill: {row['prefill_source']})"
        print(f"{row['spec']:<16} {row['context']:>7}  {row['decode_vs_fp16']:>13.2f}x  "
              f"{row['prefill_time_vs_fp16']:>14.2f}x  {row['repeats']:>7}  {row['source']}{prefill_from}")
    if not args.no_plot:
        print("plot:", plot(rows, out.with_suffix(".png")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
