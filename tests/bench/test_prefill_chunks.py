"""bench.prefill_chunks: the per-chunk split of a prefill into host building and evaluation, its
summary arithmetic, and its refusals."""

import json

import pytest

from veloxquant_mlx.bench import prefill_chunks as probe

TINY = ["--layers", "2", "--hidden", "128", "--heads", "4", "--kv-heads", "2", "--head-dim", "32",
        "--intermediate", "256", "--vocab", "256", "--prefill-step-size", "64", "--context", "257"]


def test_line_fit_recovers_a_line_and_refuses_one_point():
    assert probe.line_fit([0, 1, 2], [1.0, 3.0, 5.0]) == pytest.approx({"intercept": 1.0, "slope": 2.0})
    assert probe.line_fit([4, 4], [1.0, 2.0]) is None


def test_summary_takes_medians_and_splits_the_excess_over_fp16():
    def fill(total, host, ev):
        return {"total_s": total, "peak_over_start_bytes": int(total * 100), "chunks": [{"history": h, "host_ms": host, "eval_ms": ev + h / 1024}
                                             for h in (0, 1024, 2048)]}

    summary = probe.with_ratios({
        "fp16": probe.summarize([fill(1.0, 1.0, 10.0), fill(3.0, 1.0, 10.0), fill(2.0, 1.0, 10.0)]),
        "kivi": probe.summarize([fill(3.0, 2.0, 12.0)]),
    })
    fp16, kivi = summary["fp16"], summary["kivi"]
    assert fp16["total_s"] == 2.0 and kivi["total_vs_fp16"] == 1.5
    assert fp16["peak_over_start_bytes"] == 300 and kivi["peak_over_start_bytes"] == 300  # the largest fill's
    assert fp16["host_s"] == pytest.approx(0.003) and fp16["eval_s"] == pytest.approx(0.033)
    assert kivi["excess_host_s"] == pytest.approx(0.003) and kivi["excess_eval_s"] == pytest.approx(0.006)
    assert kivi["eval_fit_ms_per_1k_history"] == pytest.approx({"intercept": 12.0, "slope": 1.0})


def test_a_tiny_run_times_every_chunk_of_each_spec(tmp_path, capsys):
    out = tmp_path / "pc.json"
    assert probe.main([*TINY, "--methods", "kivi", "--fills", "1", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert list(data["specs"]) == ["fp16", "kivi"]  # the reference is added first
    for name in ("fp16", "kivi"):
        (fill,) = data["specs"][name]["fills"]
        # 256 prompt tokens fed (the last one gives the logits), in chunks of 64
        assert [c["history"] for c in fill["chunks"]] == [0, 64, 128, 192]
        assert all(c["host_ms"] > 0 and c["eval_ms"] > 0 for c in fill["chunks"])
        s = data["summary"][name]
        assert s["total_s"] >= s["host_s"] + s["eval_s"] > 0
    assert data["summary"]["fp16"]["total_vs_fp16"] == 1.0
    assert "kivi" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--fills", "0"], "--fills 0: allowed is an integer >= 1"),
    (["--set", "fused_decode.NOPE=1"], "--set"),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        probe.parse_args(["--out", "x.json", *argv])
    assert message in capsys.readouterr().err
