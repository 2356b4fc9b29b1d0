"""Self-describing results: JSON with the command and the machine, and PNG plots.

Every result file holds `command` (the exact command line), `machine` (platform, CPU, cores,
MLX and mlx-lm versions, backend, the OpenBLAS preload, load average at the start) and `date`
(UTC), so a figure in the README can name where it came from. Plots use matplotlib's Agg
backend and only read the JSON: `python -m veloxquant_mlx.bench.report FILE.json` redraws them,
which is how GPU results (the device has no matplotlib) get their plots here.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _backend() -> dict:
    try:
        import mlx.core as mx
    except ImportError:
        return {"mlx": None}
    info = {"mlx": getattr(mx, "__version__", None), "default_device": str(mx.default_device())}
    for name in ("metal", "cuda"):
        module = getattr(mx, name, None)
        try:
            info[f"{name}_available"] = bool(module.is_available()) if module else False
        except Exception:  # noqa: BLE001 - introspection only
            info[f"{name}_available"] = False
    try:
        info["device_info"] = {k: (v if isinstance(v, (int, float, str)) else str(v))
                               for k, v in dict(mx.device_info()).items()}
    except Exception:  # noqa: BLE001
        pass
    return info


def _gpu_name() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=5, cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def _package_changed_since_commit() -> bool | None:
    """True when the package's files differ from the commit git_commit names (a copy of the tree
    whose .git is older than its files, as the device machine's, or uncommitted edits)."""
    package = Path(__file__).resolve().parents[1]
    try:
        out = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", str(package)], capture_output=True,
                             timeout=10, cwd=package)
    except (OSError, subprocess.SubprocessError):
        return None
    return {0: False, 1: True}.get(out.returncode)


def source_digest(package: Path | None = None) -> str:
    """sha256 (12 hex digits) over the package's .py files (`package`: this one when None),
    path and content, in path order: names the code a result ran, whether or not the tree it
    ran from had git history."""
    package = Path(__file__).resolve().parents[1] if package is None else package
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def machine_info() -> dict:
    try:
        import mlx_lm

        mlx_lm_version = mlx_lm.__version__
    except ImportError:
        mlx_lm_version = None
    try:
        load = list(os.getloadavg())
    except OSError:
        load = None
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "gpu": _gpu_name(),
        "python": platform.python_version(),
        "mlx_lm": mlx_lm_version,
        "backend": _backend(),
        "ld_preload": os.environ.get("LD_PRELOAD") or None,
        "load_average_at_start": load,
        "git_commit": _git_commit(),
        "package_changed_since_commit": _package_changed_since_commit(),
        "source_digest": source_digest(),
    }


def _command_line() -> list[str]:
    # orig_argv keeps "python -m package.module"; sys.argv would show the module's file path.
    argv = list(getattr(sys, "orig_argv", None) or sys.argv)
    if argv and argv[0] == sys.executable or (argv and Path(argv[0]).name.startswith("python")):
        argv[0] = Path(argv[0]).name
    return argv


def header(argv: list[str] | None = None) -> dict:
    argv = _command_line() if argv is None else argv
    return {
        "command": shlex.join(argv),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
    }


def write_json(result: dict, path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(result, indent=2, default=str) + "\n", encoding="utf-8")
    tmp.replace(path)  # a crash mid-write never leaves half a file
    return path


# ---- plots ------------------------------------------------------------------------------------
def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _subtitle(result: dict) -> str:
    machine = result.get("machine", {})
    where = machine.get("gpu") or machine.get("cpu") or "?"
    backend = machine.get("backend", {}).get("default_device", "")
    return f"{where} ({backend}), mlx {machine.get('backend', {}).get('mlx')}, {result.get('date', '')[:10]}"


def _plotted(case: dict, metric: str) -> dict:
    """{median, min, max} of `metric` for the plot: gpu_speed's figure where the case has one
    (prefill: the fastest repeat with the repeats' range; decode: its figure with the range of
    repeats or interleaved rounds), else the summary over repeats."""
    fig = case.get("figure")
    if not fig:
        return case.get(metric) or {}
    if metric == "prefill_tps":
        repeats = fig.get("prefill_repeats_s") or []
        return {"median": fig.get("prefill_tps"), "min": case["context"] / max(repeats) if repeats else None,
                "max": fig.get("prefill_tps")}
    return {"median": fig.get("decode_tps"), "min": fig.get("decode_tps_min"), "max": fig.get("decode_tps_max")}


# Markers cycled beside the colours: a series stays told apart where two lines cross or where
# a printout loses the colours.
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "h")


def series_style(index: int, count: int) -> tuple:
    """(colour, marker) of series `index` of `count`: matplotlib's 10 default colours while they
    suffice, else its 20-colour map (the default cycle would repeat a colour from the 11th line
    on: a default bench run draws 11 specs)."""
    import matplotlib

    colors = matplotlib.colormaps["tab10" if count <= 10 else "tab20"].colors
    return colors[index % len(colors)], _MARKERS[index % len(_MARKERS)]


def plot_speed(result: dict, path: str | os.PathLike) -> Path | None:
    """Decode tokens/s (and prefill) against context, one line per spec, min-max bars (for
    gpu_speed results: its figures, gpu_speed_figures.py)."""
    cases = result.get("speed", {}).get("cases") or result.get("cases") or []
    cases = [c for c in cases if _plotted(c, "decode_tps").get("median")]
    if not cases:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    specs = list(dict.fromkeys(c["spec"] for c in cases))
    for metric, ax, title in (("decode_tps", axes[0], "decode tokens/s"),
                              ("prefill_tps", axes[1], "prefill tokens/s")):
        for index, spec in enumerate(specs):
            rows = sorted((c for c in cases if c["spec"] == spec), key=lambda c: c["context"])
            xs = [c["context"] for c in rows]
            stats = [_plotted(c, metric) for c in rows]
            med = [st.get("median") for st in stats]
            lo = [m - (st["min"] if st.get("min") is not None else m) if m is not None else 0
                  for m, st in zip(med, stats)]
            hi = [(st["max"] if st.get("max") is not None else m) - m if m is not None else 0
                  for m, st in zip(med, stats)]
            med = [m if m is not None else float("nan") for m in med]
            style = "--" if rows[0].get("kind") in ("fp16", "mlx-quantized") else "-"
            color, marker = series_style(index, len(specs))
            ax.errorbar(xs, med, yerr=[lo, hi], marker=marker, color=color, linestyle=style, capsize=3,
                        label=rows[0].get("label", spec))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(title)
        ax.set_title(title + (" (figure, range)" if rows and rows[0].get("figure") else " (median, min-max)"))
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(_subtitle(result), fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_quality(result: dict, path: str | os.PathLike) -> Path | None:
    """KL(ref || q) and top-1 agreement against cache bytes / fp16 bytes, one point per spec."""
    rows = [r for r in result.get("quality", [])
            if r.get("kl_mean") is not None and r.get("bytes_ratio_vs_fp16")]
    if not rows:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, ylabel, log in ((axes[0], "kl_mean", "mean KL(ref || cache)", True),
                                 (axes[1], "top1_agreement", "top-1 agreement with fp16", False)):
        for index, r in enumerate(rows):
            x = r["bytes_ratio_vs_fp16"]
            y = r[key]
            if log:
                y = max(y, 1e-6)  # KL of the reference itself is 0: keep it on the log axis
            marker = "s" if r.get("kind") in ("fp16", "mlx-quantized") else "o"
            ax.scatter([x], [y], marker=marker, s=50, color=series_style(index, len(rows))[0])
            ax.annotate(r.get("label", r["spec"]), (x, y), fontsize=7, xytext=(4, 4),
                        textcoords="offset points")
        if log:
            ax.set_yscale("log")
        ax.set_xlabel("cache bytes / fp16 bytes of the same tokens (end of the quality run)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    fig.suptitle("quality against bytes -- " + _subtitle(result), fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_all(result: dict, json_path: str | os.PathLike) -> list[Path]:
    stem = Path(json_path).with_suffix("")
    made = [plot_speed(result, f"{stem}_speed.png"), plot_quality(result, f"{stem}_quality.png")]
    return [p for p in made if p is not None]


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m veloxquant_mlx.bench.report",
        description="Redraw the PNG plots of result files (FILE_speed.png, FILE_quality.png beside each).")
    p.add_argument("results", nargs="+", metavar="RESULT.json", help="result files written by the bench modules")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    for name in args.results:
        try:
            result = json.loads(Path(name).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            p.error(f"{name}: {exc}; allowed is a JSON result file of the bench modules")
        if not isinstance(result, dict):
            p.error(f"{name}: a JSON {type(result).__name__}; allowed is a bench result object")
        made = plot_all(result, name)
        if not made:
            print(f"{name}: no speed cases with a decode median and no quality rows: nothing to draw",
                  file=sys.stderr)
        for path in made:
            print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
