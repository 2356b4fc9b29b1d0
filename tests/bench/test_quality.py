"""The quality part, delegated to veloxquant_mlx.quality, on a tiny random model (bytes as tokens)."""

from veloxquant_mlx.bench import report
from veloxquant_mlx.bench.methods import parse_specs, with_reference
from veloxquant_mlx.bench.quality import run_quality


class ByteTokenizer:
    def encode(self, text):
        return list(text.encode("utf-8"))


def test_quality_rows_and_plot(tiny_model, tmp_path):
    specs = with_reference(parse_specs(["mlx-q8", "mlx-q2:group_size=32"]))
    rows = run_quality(tiny_model, ByteTokenizer(), specs, progress=False)
    by = {r["spec"]: r for r in rows}
    assert set(by) == {"fp16", "mlx-q8", "mlx-q2:group_size=32"}
    for row in rows:
        assert "error" not in row, row
        assert row["n_tokens"] == 512 and row["n_positions"] == 384
        assert row["fp16_bytes_after_run"] == 2 * 2 * 511 * 64 * 2
    assert by["fp16"]["kl_mean"] < 1e-6 and by["fp16"]["top1"] == 1.0
    assert by["mlx-q8"]["kl_mean"] < by["mlx-q2:group_size=32"]["kl_mean"]
    assert by["mlx-q2:group_size=32"]["bytes_ratio_vs_fp16"] < by["mlx-q8"]["bytes_ratio_vs_fp16"]
    path = report.plot_quality({"quality": rows}, tmp_path / "q.png")
    assert path is not None and path.stat().st_size > 1000


def test_report_redraw_refuses_what_is_not_a_result(tmp_path, capsys):
    import pytest

    with pytest.raises(SystemExit) as missing:
        report.main([str(tmp_path / "missing.json")])
    assert missing.value.code == 2 and "missing.json" in capsys.readouterr().err
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(SystemExit):
        report.main([str(listed)])
    assert "allowed is a bench result object" in capsys.readouterr().err
    empty = tmp_path / "empty.json"
    empty.write_text("{}")
    assert report.main([str(empty)]) == 0
    assert "nothing to draw" in capsys.readouterr().err
