"""`policy simulate FILE --plot OUT.png`: a policy's decision map, for reviewers.

seq_len on a log x axis against memory pressure (pressure_fraction) on y, each point coloured by
the method the policy chooses, one panel per head_dim band (the policy's own head_dim bands;
neighbouring bands whose decisions are identical everywhere on the map share a panel), plus a
strip above each panel for unknown memory (pressure null). Other facts are fixed and named in
the figure: n_layers=32, batch_size=1, no memory in use before the cache (the pressure is set
through the memory total). The map is sampled on a grid, so a band narrower than a grid step
(seq_len == 2048, pressure == 0.75 exactly) may not show: the simulate table is the exact view.

matplotlib is imported lazily, with the Agg backend (no display): it is in the `test` and
`bench` extras only, and `import veloxquant_mlx` must not need it.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from veloxquant_mlx.config.fields import METHODS
from veloxquant_mlx.config.hardware import HardwareInfo
from veloxquant_mlx.config.workload import WorkloadSpec
from veloxquant_mlx.errors import PolicyError, VeloxQuantError
from veloxquant_mlx.policy.bands import bands_of, describe_range
from veloxquant_mlx.policy.compiler import CompiledPolicy
from veloxquant_mlx.policy.evaluator import choose
from veloxquant_mlx.policy.facts import facts_of

FIGSIZE = (12.0, 5.0)  # inches, at DPI: every map is 1200 x 500 pixels whatever the panels
DPI = 100
N_LAYERS, BATCH = 32, 1
X_POINTS, Y_POINTS = 240, 120
Y_MAX = 1.5
# One fixed colour per method (tab10), so the same method has the same colour in every map.
METHOD_COLOURS = dict(zip(METHODS, ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                                    "#8c564b", "#e377c2")))
GAP_COLOUR = "#ffffff"
ERROR_COLOUR = "#000000"


class PlotUnavailableError(VeloxQuantError):
    """matplotlib is not installed (the CLI prints this as one line and exits 2)."""


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailableError("--plot needs matplotlib, which is not installed: pip install "
                                   "'VeloxQuant-MLX[bench]' (or matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _axes(policy: CompiledPolicy):
    top = max([float(t) for t in policy.thresholds().get("seq_len", ())] + [2.0**17])
    x_max = 2 ** math.ceil(math.log2(top * 4))
    xs = [round(math.exp(math.log(x_max) * (i + 0.5) / X_POINTS)) for i in range(X_POINTS)]
    x_edges = [math.exp(math.log(x_max) * i / X_POINTS) for i in range(X_POINTS + 1)]
    ys = [Y_MAX * (j + 0.5) / Y_POINTS for j in range(Y_POINTS)]
    y_edges = [Y_MAX * j / Y_POINTS for j in range(Y_POINTS + 1)]
    return xs, x_edges, ys, y_edges


def _decision(policy: CompiledPolicy, head_dim: int, seq_len: int, pressure):
    """(label, key): label is a method, "gap" or "error"; key is the full outcome, used to
    decide whether two head_dim bands can share a panel."""
    workload = WorkloadSpec(head_dim=head_dim, seq_len=max(1, seq_len), n_layers=N_LAYERS, batch_size=BATCH)
    if pressure is None:
        hardware = HardwareInfo()
    else:
        hardware = HardwareInfo(max(1, round(workload.fp16_kv_bytes() / pressure)), 0)
    facts = facts_of(workload, hardware)
    chosen = choose(policy, facts)
    if chosen is None:
        return "gap", "gap"
    rule, applied = chosen
    try:
        config = policy.config_for(rule.index, applied, facts["n_layers"])
    except PolicyError:
        return "error", ("error", rule.id)
    return config.method, (rule.id, applied, config)


def _panel_grids(policy: CompiledPolicy, head_dim: int, xs, ys):
    """method grid (rows of y, plus the unknown-memory row first), outcome keys, rules seen."""
    labels, keys, rules = [], [], {}
    for pressure in [None, *ys]:
        row_labels, row_keys = [], []
        for seq_len in xs:
            label, key = _decision(policy, head_dim, seq_len, pressure)
            row_labels.append(label)
            row_keys.append(key)
            if isinstance(key, tuple) and label not in ("gap", "error"):
                rules.setdefault(label, {})[key[0]] = None
        labels.append(row_labels)
        keys.append(row_keys)
    return labels, keys, rules


def _head_dim_panels(policy: CompiledPolicy, xs, ys):
    """[(title, head_dim, labels, rules)] with neighbouring identical bands merged."""
    bands = bands_of("head_dim", policy.thresholds().get("head_dim", ()))
    panels = []
    for index, band in enumerate(bands):
        head_dim = 128 if band.contains(128) else (band.lo if band.lo & (band.lo - 1) == 0
                                                   else 1 << math.ceil(math.log2(band.lo)))
        labels, keys, rules = _panel_grids(policy, head_dim, xs, ys)
        if panels and panels[-1]["keys"] == keys:
            panels[-1]["last"] = index
            continue
        panels.append({"first": index, "last": index, "head_dim": head_dim, "labels": labels,
                       "keys": keys, "rules": rules})
    out = []
    for panel in panels:
        title = describe_range("head_dim", bands, panel["first"], panel["last"]) or "every head_dim"
        out.append((f"{title} (drawn at head_dim={panel['head_dim']})", panel["labels"], panel["rules"]))
    return out


def plot_decision_map(policy: CompiledPolicy, path: str | os.PathLike) -> Path:
    """Draw the map to path (PNG); returns the path."""
    plt = _pyplot()
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    xs, x_edges, ys, y_edges = _axes(policy)
    panels = _head_dim_panels(policy, xs, ys)
    order = [*METHODS, "gap", "error"]
    colours = [*(METHOD_COLOURS[m] for m in METHODS), GAP_COLOUR, ERROR_COLOUR]
    cmap = ListedColormap(colours)

    fig = plt.figure(figsize=FIGSIZE, dpi=DPI)
    grid = fig.add_gridspec(2, len(panels), height_ratios=(1, 9), hspace=0.08, wspace=0.12,
                            left=0.06, right=0.80, top=0.84, bottom=0.12)
    seen: dict = {}
    for column, (title, labels, rules) in enumerate(panels):
        for method, ids in rules.items():
            seen.setdefault(method, {}).update(ids)
        if any("gap" in row for row in labels):
            seen.setdefault("gap", {})
        if any("error" in row for row in labels):
            seen.setdefault("error", {})
        codes = [[order.index(label) for label in row] for row in labels]
        strip = fig.add_subplot(grid[0, column])
        strip.pcolormesh(x_edges, [0, 1], [codes[0]], cmap=cmap, vmin=-0.5, vmax=len(order) - 0.5)
        strip.set_xscale("log")
        strip.set_xticks([])
        strip.set_yticks([0.5])
        strip.set_yticklabels(["unknown" if column == 0 else ""], fontsize=8)
        strip.set_title(title, fontsize=9)
        ax = fig.add_subplot(grid[1, column], sharex=strip)
        ax.pcolormesh(x_edges, y_edges, codes[1:], cmap=cmap, vmin=-0.5, vmax=len(order) - 0.5)
        ax.set_xscale("log", base=2)
        ax.set_xlim(x_edges[0], x_edges[-1])
        ax.set_ylim(0, Y_MAX)
        ax.set_xlabel("seq_len (tokens, log scale)")
        if column == 0:
            ax.set_ylabel("memory pressure: (active + fp16 KV) / total")
        else:
            ax.tick_params(labelleft=False)
        ax.grid(True, which="major", color="#ffffff", alpha=0.35, linewidth=0.6)
        strip.tick_params(labelbottom=False, bottom=False)
    handles = []
    for name in order:
        if name not in seen:
            continue
        if name == "gap":
            handles.append(Patch(facecolor=GAP_COLOUR, edgecolor="#888888", label="no rule (gap)"))
        elif name == "error":
            handles.append(Patch(facecolor=ERROR_COLOUR, label="per-layer list does not fit"))
        else:
            handles.append(Patch(facecolor=METHOD_COLOURS[name],
                                 label=f"{name}\n({', '.join(seen[name])})"))
    fig.legend(handles=handles, loc="center right", fontsize=8, title="method (rules)",
               title_fontsize=9, frameon=False)
    fig.suptitle(f"policy {policy.name} v{policy.version}: decision map", fontsize=12)
    fig.text(0.43, 0.905, f"n_layers={N_LAYERS}, batch_size={BATCH}, nothing else in memory; the top "
             "strip is an unknown memory total", ha="center", fontsize=8, color="#444444")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path
