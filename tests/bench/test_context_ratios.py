"""bench.context_ratios: ratios taken inside one gpu_speed file, from its raw runs."""

import json

import pytest

from veloxquant_mlx.bench import context_ratios


def _run(decode_tps, prefill_s):
    return {"decode_tps": decode_tps, "decode_interval_ms_median": 1000 / decode_tps, "prefill_s": prefill_s}


def _file(tmp_path, name, cases):
    path = tmp_path / name
    path.write_text(json.dumps({"cases": cases}))
    return str(path)


def test_decode_is_the_median_of_repeats_and_prefill_the_fastest_repeat(tmp_path):
    path = _file(tmp_path, "a.json", [
        {"spec": "fp16", "context": 4096, "runs": [_run(500, 1.0), _run(400, 0.5), _run(450, 0.5)]},
        # A cold first repeat (slow prefill) must not count: the fastest is taken.
        {"spec": "kivi", "context": 4096, "runs": [_run(300, 2.0), _run(360, 0.6), _run(450, 0.7)]},
    ])
    (row,) = context_ratios.collect([path])
    assert row["spec"] == "kivi" and row["context"] == 4096
    assert row["decode_vs_fp16"] == pytest.approx(360 / 450)
    assert row["prefill_time_vs_fp16"] == pytest.approx(0.6 / 0.5)
    assert row["repeats"] == 3 and row["source"] == path


def test_a_later_file_wins_and_a_spec_without_fp16_at_its_context_is_left_out(tmp_path):
    old = _file(tmp_path, "old.json", [
        {"spec": "fp16", "context": 32768, "runs": [_run(400, 0.4)]},
        {"spec": "gear", "context": 32768, "runs": [_run(100, 4.0)]},
        {"spec": "gear", "context": 65536, "runs": [_run(100, 4.0)]},  # no fp16 at 64K here
    ])
    new = _file(tmp_path, "new.json", [
        {"spec": "fp16", "context": 32768, "runs": [_run(500, 0.5)]},
        {"spec": "gear", "context": 32768, "runs": [_run(400, 1.0)]},
        {"spec": "mlx-q4", "context": 32768, "runs": []},  # failed: no finished run
    ])
    rows = context_ratios.collect([old, new])
    assert [(r["spec"], r["context"]) for r in rows] == [("gear", 32768)]
    assert rows[0]["source"] == new and rows[0]["decode_vs_fp16"] == pytest.approx(0.8)


def test_a_file_that_is_not_a_gpu_speed_result_is_refused_by_name(tmp_path):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"quality": []}))
    with pytest.raises(SystemExit, match="other.json is not a bench.gpu_speed result"):
        context_ratios.collect([str(path)])


def test_main_writes_the_table_and_the_plot(tmp_path, capsys):
    path = _file(tmp_path, "a.json", [
        {"spec": "fp16", "context": 2048, "runs": [_run(500, 0.1), _run(500, 0.1)]},
        {"spec": "kivi", "context": 2048, "runs": [_run(450, 0.2), _run(460, 0.2)]},
        {"spec": "fp16", "context": 4096, "runs": [_run(400, 0.2)]},
        {"spec": "kivi", "context": 4096, "runs": [_run(420, 0.3)]},
    ])
    out = tmp_path / "ratios.json"
    assert context_ratios.main([path, "--out", str(out)]) == 0
    table = json.loads(out.read_text())
    assert [(r["spec"], r["context"]) for r in table["rows"]] == [("kivi", 2048), ("kivi", 4096)]
    assert out.with_suffix(".png").stat().st_size > 0
    assert "kivi" in capsys.readouterr().out


def test_an_interleaved_file_gives_the_median_of_the_paired_round_ratios(tmp_path):
    def rounds(*medians):
        return {"rounds": [{"round": i, "intervals_ms": [m, m]} for i, m in enumerate(medians)]}

    path = _file(tmp_path, "i.json", [
        {"spec": "fp16", "context": 32768, "runs": [{"prefill_s": 0.4}], "interleaved": rounds(2.0, 4.0, 3.0)},
        {"spec": "kivi", "context": 32768, "runs": [{"prefill_s": 0.5}], "interleaved": rounds(2.5, 4.0, 3.0)},
    ])
    (row,) = context_ratios.collect([path])
    # Per round fp16 / kivi: 0.8, 1.0, 1.0 (drift between rounds divides out).
    assert row["decode_vs_fp16"] == pytest.approx(1.0)
    assert row["decode_ratio_basis"] == "paired interleaved rounds"
    assert row["prefill_time_vs_fp16"] == pytest.approx(0.5 / 0.4)


def test_a_cold_prefill_never_replaces_a_warm_one_while_the_newer_decode_wins(tmp_path):
    # An older file with two prefill repeats each, a newer interleaved one with one cold repeat:
    # decode from the newer (paired rounds), prefill kept from the older; a warm newer one wins.
    def rounds(*medians):
        return {"rounds": [{"round": i, "intervals_ms": [m, m]} for i, m in enumerate(medians)]}

    old = _file(tmp_path, "old.json", [
        {"spec": "fp16", "context": 32768, "runs": [_run(400, 0.4), _run(400, 0.36)]},
        {"spec": "kivi", "context": 32768, "runs": [_run(320, 0.6), _run(330, 0.5)]},
    ])
    new = _file(tmp_path, "new.json", [
        {"spec": "fp16", "context": 32768, "runs": [{"prefill_s": 1.1}], "interleaved": rounds(2.0, 2.0)},
        {"spec": "kivi", "context": 32768, "runs": [{"prefill_s": 1.8}], "interleaved": rounds(2.2, 2.2)},
    ])
    (row,) = context_ratios.collect([old, new])
    assert row["source"] == new and row["decode_vs_fp16"] == pytest.approx(2.0 / 2.2)
    assert row["prefill_source"] == old and row["prefill_time_vs_fp16"] == pytest.approx(0.5 / 0.36)
    assert row["prefill_warm"]
    warm_new = _file(tmp_path, "warm.json", [
        {"spec": "fp16", "context": 32768, "runs": [_run(500, 0.3), _run(500, 0.3)]},
        {"spec": "kivi", "context": 32768, "runs": [_run(450, 0.33), _run(450, 0.36)]},
    ])
    (row,) = context_ratios.collect([old, new, warm_new])
    assert row["prefill_source"] == warm_new and row["prefill_time_vs_fp16"] == pytest.approx(1.1)


def test_a_panels_axis_ends_above_its_warm_points_whatever_a_cold_one_reads():
    # A cold 4K prefill at 31x fp16's (session 24: every kernel's JIT compile) must not set the
    # axis: it ends AXIS_HEADROOM above the highest warm point, or at AXIS_FLOOR.
    assert context_ratios.axis_top([0.9, 1.8]) == pytest.approx(1.8 * context_ratios.AXIS_HEADROOM)
    assert context_ratios.axis_top([0.5]) == context_ratios.AXIS_FLOOR
    assert context_ratios.axis_top([]) == context_ratios.AXIS_FLOOR
