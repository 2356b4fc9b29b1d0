import json

import pytest

from veloxquant_mlx.bench import gpu_speed

TINY = ["--layers", "1", "--hidden", "128", "--heads", "2", "--kv-heads", "1", "--head-dim", "64",
        "--intermediate", "128", "--vocab", "300", "--dtype", "float32"]


def test_quick_run_end_to_end_on_the_cpu(tmp_path):
    out = tmp_path / "g.json"
    code = gpu_speed.main(["--quick", *TINY, "--contexts", "96,64", "--methods", "fp16,mlx-q4",
                           "--prefill-step-size", "32", "--out", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["settings"]["quick"] and result["settings"]["decode_tokens"] == 8
    assert result["settings"]["warmup_context"] == 64 and result["settings"]["constants_set"] == {}
    assert set(result["warmup"]) == {"fp16", "mlx-q4"}
    assert [(c["spec"], c["context"]) for c in result["cases"]] == [
        ("fp16", 64), ("mlx-q4", 64), ("fp16", 96), ("mlx-q4", 96)]
    for case in result["cases"]:
        assert "error" not in case and case["decode_tps"]["median"] > 0
        assert case["bytes_ratio_vs_fp16"] > 0 and case["peak_bytes"]["median"] > 0
    assert result["cases"][1]["ratio_vs"]["fp16"]["decode_tps"] > 0
    assert result["machine"]["backend"]["mlx"] and result["elapsed_s"] > 0


def test_failures_and_budget_are_recorded(tmp_path):
    out = tmp_path / "g.json"
    # head_dim 32 cannot be quantized in groups of 64: mlx-q4 fails, fp16 runs, run goes on.
    tiny32 = [a if a != "64" else "32" for a in TINY]
    assert gpu_speed.main(["--quick", *tiny32, "--contexts", "40", "--methods", "fp16,mlx-q4",
                           "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    cases = {c["spec"]: c for c in result["cases"]}
    # Its warm-up failed: the error is recorded there and its timed case is not run.
    assert "error" not in cases["fp16"] and result["warmup"]["mlx-q4"]["error"]
    assert cases["mlx-q4"]["skipped"].startswith("not run: its warm-up at 40 tokens failed")
    assert cases["mlx-q4"]["runs"] == [] and "error" not in cases["mlx-q4"]
    # Asked to, it runs anyway and records the case's own error.
    assert gpu_speed.main(["--quick", *tiny32, "--contexts", "40", "--methods", "fp16,mlx-q4",
                           "--run-after-failed-warmup", "--out", str(out)]) == 0
    cases = {c["spec"]: c for c in json.loads(out.read_text())["cases"]}
    assert cases["mlx-q4"]["error"] and "skipped" not in cases["mlx-q4"]
    assert gpu_speed.main(["--quick", *TINY, "--contexts", "40", "--methods", "fp16",
                           "--budget-s", "0", "--out", str(out)]) == 0
    (case,) = json.loads(out.read_text())["cases"]
    assert case["skipped"].startswith("budget") and case["runs"] == []


def test_targets_compare_ours_with_fp16_and_prefer_the_paired_decode_ratio():
    def case(spec, kind, context, decode_ratio, prefill_time, paired=None):
        vs = {"decode_tps": decode_ratio, "prefill_time": prefill_time}
        if paired is not None:
            vs["decode_tps_paired"] = paired
        return {"spec": spec, "kind": kind, "context": context, "ratio_vs": {"fp16": vs} if kind == "ours" else {}}
    rows = gpu_speed.check_targets([case("fp16", "fp16", 32768, None, None),
                                    case("kivi", "ours", 32768, 0.95, 1.3),
                                    case("kivi", "ours", 131072, 0.99, 5.0),
                                    case("gear", "ours", 131072, 0.8, None, paired=1.02)])
    met = {(r["spec"], r["context"], r["target"].split()[0]): (r["met"], r["basis"]) for r in rows}
    assert met == {("kivi", 32768, "decode"): (True, "decode figures (median over repeats)"),
                   ("kivi", 32768, "prefill"): (False, "fastest repeat of each"),
                   ("kivi", 131072, "decode"): (False, "decode figures (median over repeats)"),
                   ("gear", 131072, "decode"): (True, "median of per-round ratios (interleaved)")}


def test_each_finished_run_is_saved_and_a_cut_file_can_be_recomputed(tmp_path, monkeypatch):
    out = tmp_path / "g.json"
    seen = []
    real_save = gpu_speed.check_targets

    def spy(cases):  # called by every save: record what the file held at that moment
        seen.append([(c["spec"], c["context"], len(c["runs"])) for c in cases])
        return real_save(cases)

    monkeypatch.setattr(gpu_speed, "check_targets", spy)
    assert gpu_speed.main(["--quick", *TINY, "--contexts", "64", "--methods", "fp16,kivi",
                           "--prefill-step-size", "32", "--out", str(out)]) == 0
    # fp16's finished run was in the file before kivi's run started (not only at the context's end)
    assert [("fp16", 64, 1), ("kivi", 64, 0)] in seen
    monkeypatch.undo()
    result = json.loads(out.read_text())
    # A file cut short keeps only runs: the summaries, ratios and targets are re-derived.
    for case in result["cases"]:
        for key in ("decode_tps", "prefill_s", "ratio_vs", "bytes_ratio_vs_fp16"):
            case.pop(key)
    result["targets"] = None
    out.write_text(json.dumps(result))
    assert gpu_speed.main(["--recompute", str(out)]) == 0
    again = json.loads(out.read_text())
    kivi = {c["spec"]: c for c in again["cases"]}["kivi"]
    assert kivi["decode_tps"]["n"] == 1 and kivi["ratio_vs"]["fp16"]["decode_tps"] > 0
    assert again["targets"] == [] and again["recomputed_by"].endswith(str(out))


def test_set_records_the_constant_and_a_bad_name_is_a_usage_error(tmp_path, monkeypatch, capsys):
    from veloxquant_mlx.cache import prefill_pieces

    monkeypatch.setattr(prefill_pieces, "SYNC", prefill_pieces.SYNC)  # restored afterwards
    out = tmp_path / "g.json"
    assert gpu_speed.main(["--quick", *TINY, "--contexts", "64", "--methods", "fp16", "--prefill-step-size", "32",
                           "--set", "prefill_pieces.SYNC=0", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["settings"]["constants_set"] == {
        "veloxquant_mlx.cache.prefill_pieces.SYNC": {"default": 1, "set": 0}}
    with pytest.raises(SystemExit):
        gpu_speed.main(["--set", "prefill_pieces.NOPE=1", "--out", str(out)])
    assert "--set: 'prefill_pieces.NOPE=1'" in capsys.readouterr().err


def test_decode_rounds_may_start_for_an_allowance_past_the_budget(tmp_path, monkeypatch, capsys):
    # A fresh machine's run can spend --budget-s on warm-ups and cold prefills (JIT compiles):
    # the decode rounds, ~0.2 s each, still get --rounds-allowance-s (session 13 lost a run so).
    from veloxquant_mlx.bench import gpu_speed_interleave
    from veloxquant_mlx.bench.methods import parse_spec

    seen = {}
    monkeypatch.setattr(gpu_speed_interleave, "run_context",
                        lambda *a, over_budget, may_start, **kw: seen.update(rounds=over_budget, prefills=may_start))
    clock = [0.0]
    def ticking():  # a clock the test sets; each reading a millisecond on (timings divide by it)
        clock[0] += 1e-3
        return clock[0]

    monkeypatch.setattr(gpu_speed.time, "perf_counter", ticking)
    out = tmp_path / "g.json"
    assert gpu_speed.main(["--quick", *TINY, "--contexts", "40", "--methods", "fp16", "--interleave",
                           "--budget-s", "5", "--rounds-allowance-s", "30", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["settings"]["rounds_allowance_s"] == 30.0
    clock[0] = 10.0  # past the budget: no new prefill, rounds still go on
    assert seen["rounds"]() is None
    case = {}
    assert seen["prefills"](parse_spec("fp16"), case, "prefill 1 of 1") is False
    assert case["skipped"].startswith("budget: 10 s spent of --budget-s 5")
    clock[0] = 36.0
    assert "--rounds-allowance-s 30" in seen["rounds"]()
    with pytest.raises(SystemExit):
        gpu_speed.parse_args(["--out", "x.json", "--rounds-allowance-s", "-1"])
    assert "--rounds-allowance-s -1.0: allowed is a number >= 0" in capsys.readouterr().err
