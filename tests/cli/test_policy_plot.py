"""`veloxquant policy simulate FILE --plot OUT.png`: the decision map is drawn, has the fixed
size, shows the methods in their colours; without matplotlib one clean line and exit 2."""

import sys

import pytest

from veloxquant_mlx.cli.main import main
from veloxquant_mlx.policy import sources
from veloxquant_mlx.policy.plot import DPI, FIGSIZE, METHOD_COLOURS
from veloxquant_mlx.policy.sources import default_policy_path


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv(sources.ENV_VAR, raising=False)


def _colour_counts(png) -> dict:
    import matplotlib.image as mpimg
    import numpy as np

    pixels = (mpimg.imread(png)[..., :3] * 255).round().astype(int)
    counts = {}
    for method, colour in METHOD_COLOURS.items():
        rgb = np.array([int(colour[i:i + 2], 16) for i in (1, 3, 5)])
        counts[method] = int((np.abs(pixels - rgb).max(axis=-1) <= 2).sum())
    return counts, pixels.shape


def test_plot_v1_decision_map(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "maps" / "v1.png"
    code = main(["policy", "simulate", str(default_policy_path(1)), "--plot", str(out)])
    printed = capsys.readouterr().out
    assert code == 0 and f"decision map written to {out}" in printed
    assert "simulate default v1" in printed  # the table is still printed
    assert out.is_file() and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    counts, shape = _colour_counts(out)
    assert shape[:2] == (int(FIGSIZE[1] * DPI), int(FIGSIZE[0] * DPI))
    # The four seed methods fill regions of the map (legend patches alone are a few hundred px).
    big = {method for method, n in counts.items() if n > 5000}
    assert big == {"turboquant_rvq", "kivi", "kvquant", "gear"}, counts


def test_plot_json_names_the_file(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    import json

    out = tmp_path / "v2.png"
    code = main(["policy", "simulate", str(default_policy_path(2)), "--plot", str(out), "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["plot"] == str(out) and out.is_file()


def test_plot_without_matplotlib_is_one_clean_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    out = tmp_path / "x.png"
    code = main(["policy", "simulate", str(default_policy_path(1)), "--plot", str(out)])
    captured = capsys.readouterr()
    assert code == 2 and not out.exists() and captured.out == ""
    assert captured.err.count("\n") == 1 and "--plot needs matplotlib" in captured.err
    assert "Traceback" not in captured.err
