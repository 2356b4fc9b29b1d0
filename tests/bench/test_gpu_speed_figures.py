"""gpu_speed's figures: the fastest prefill repeat (the first pays the context's JIT compiles),
the decode median of per-repeat medians, and every committed H200 result re-derived by
--recompute."""

import glob
import json
import shutil
import statistics
from pathlib import Path

import pytest

from veloxquant_mlx.bench import gpu_speed
from veloxquant_mlx.bench.gpu_speed_figures import (HOST_BOUND_SHARE, case_figure, paired_ratios_by_regime,
                                                    round_regime, steps_by_regime, table_lines)

REPO = Path(__file__).resolve().parents[2]


def _run(prefill_s, interval_ms):
    return {"prefill_s": prefill_s, "decode_tps": 1000 / interval_ms, "decode_interval_ms_median": interval_ms}


def test_prefill_is_the_fastest_repeat_and_decode_the_median_of_repeat_medians():
    # Session 6's gear at 32K: 20.3 s cold, 1.87 s warm (a median would say 11.1 s).
    case = {"context": 32768, "runs": [_run(20.3, 2.0), _run(1.87, 2.5)]}
    fig = case_figure(case)
    assert fig["prefill_s"] == 1.87 and fig["prefill_repeats_s"] == [20.3, 1.87]
    assert fig["prefill_spread"] == pytest.approx(20.3 / 1.87) and fig["prefill_tps"] == 32768 / 1.87
    assert fig["prefill_may_be_cold"] is False and fig["decode_source"] == "repeats"
    assert fig["decode_interval_ms"] == 2.25 and fig["decode_tps"] == pytest.approx(1000 / 2.25)
    assert (fig["decode_tps_min"], fig["decode_tps_max"]) == (400.0, 500.0)
    # One repeat: possibly cold, unless a context warm-up ran first.
    one = {"context": 32768, "runs": [_run(1.0, 2.0)]}
    assert case_figure(one)["prefill_may_be_cold"] is True
    assert case_figure(one, context_warmup=True)["prefill_may_be_cold"] is False
    # A failed decode (no timed token) gives no decode figure; no runs, no figures.
    assert case_figure({"context": 8, "runs": [{"prefill_s": 1.0, "decode_tps": None}]})["decode_tps"] is None
    empty = case_figure({"context": 8, "runs": []})
    assert empty["prefill_s"] is None and empty["decode_tps"] is None


def test_paired_ratios_are_split_by_the_references_regime_per_round():
    def rounds(pairs):  # (interval ms, host ms) per round, three tokens each
        return {"interleaved": {"rounds": [{"round": i, "intervals_ms": [iv] * 3, "host_ms": [h] * 3}
                                           for i, (iv, h) in enumerate(pairs)]}}

    # fp16: round 0 host-bound (host = interval), round 1 waiting on the GPU, round 2 right at
    # the share (host-bound), round 3 without host times (files before session 21: no regime)
    fp16 = rounds([(2.4, 2.4), (3.8, 1.6), (3.0, 3.0 * HOST_BOUND_SHARE), (2.0, None)])
    fp16["interleaved"]["rounds"][3]["host_ms"] = []
    assert [round_regime(r) for r in fp16["interleaved"]["rounds"]] == ["host_bound", "gpu_bound", "host_bound", None]
    cache = rounds([(3.6, 2.0), (3.8, 2.0), (3.0, 2.0), (1.0, 1.0)])
    split = paired_ratios_by_regime(cache, fp16)
    assert split == {"host_bound": [pytest.approx(2.4 / 3.6), pytest.approx(1.0)], "gpu_bound": [pytest.approx(1.0)]}
    # a round only one side ran is left out, as paired_ratios leaves it
    del cache["interleaved"]["rounds"][1]
    assert paired_ratios_by_regime(cache, fp16)["gpu_bound"] == []


def test_each_spec_s_own_step_is_split_by_fp16_s_regime():
    """steps_by_regime: a spec's median step and host over fp16's host-bound / GPU-bound rounds
    (session 44: fp16 bimodal, ours steady and waiting on the GPU), and the table prints them."""
    def case(spec, pairs):
        return {"spec": spec, "context": 32768, "interleaved": {"rounds": [
            {"round": i, "intervals_ms": [iv] * 3, "host_ms": [h] * 3} for i, (iv, h) in enumerate(pairs)]}}

    fp16 = case("fp16", [(2.16, 2.15), (2.61, 1.44), (2.2, 2.2)])
    ours = case("minicache", [(2.43, 2.36), (2.38, 1.61), (2.45, 2.4)])
    assert steps_by_regime(ours, fp16) == {
        "host_bound": {"interval_ms": pytest.approx(2.44), "host_ms": pytest.approx(2.38), "rounds": 2},
        "gpu_bound": {"interval_ms": 2.38, "host_ms": 1.61, "rounds": 1}}
    assert steps_by_regime(fp16, fp16)["gpu_bound"] == {"interval_ms": 2.61, "host_ms": 1.44, "rounds": 1}
    # no round of a regime: None; a round only one side ran is left out
    only_hb = case("fp16", [(2.16, 2.15)])
    assert steps_by_regime(ours, only_hb) == {"host_bound": {"interval_ms": 2.43, "host_ms": 2.36, "rounds": 1},
                                              "gpu_bound": None}
    for c in (fp16, ours):
        c["interleaved"]["step_ms_by_fp16_regime"] = steps_by_regime(c, fp16)
        c["figure"] = {"prefill_s": None, "prefill_may_be_cold": False, "prefill_spread": None,
                       "decode_tps": None, "decode_tps_min": None, "decode_tps_max": None}
    lines = table_lines([fp16, ours])
    assert any(line.startswith("minicache") and "2.44 (2.38) x2" in line and "2.38 (1.61) x1" in line for line in lines)


COMMITTED = sorted(glob.glob(str(REPO / "results" / "gpu_speed_h200*.json")))


@pytest.mark.parametrize("path", COMMITTED, ids=[Path(p).name for p in COMMITTED])
def test_committed_h200_results_recompute_to_the_new_figures(path, tmp_path, capsys):
    copy = tmp_path / Path(path).name
    shutil.copy(path, copy)
    assert gpu_speed.main(["--recompute", str(copy)]) == 0
    result = json.loads(copy.read_text())
    assert result["recomputed_by"].endswith(str(copy))
    for case in result["cases"]:
        times = [r["prefill_s"] for r in case["runs"]]
        assert case["figure"]["prefill_s"] == (min(times) if times else None)
    for row in result["targets"]:
        assert row["basis"] in ("fastest repeat of each", "decode figures (median over repeats)",
                                "median of per-round ratios (interleaved)")
    # header, rows, [the step table's header and rows,] legend, count
    steps = [c for c in result["cases"] if (c.get("interleaved") or {}).get("step_ms_by_fp16_regime")]
    assert len(capsys.readouterr().out.splitlines()) == len(result["cases"]) + 3 + (len(steps) + 1 if steps else 0)


def test_session4_32k_prefill_ratio_is_taken_between_warm_repeats():
    # results/gpu_speed_h200_s4.json, 32K: fp16 ran 1.82 s (cold) then 0.41 s; its median (1.11 s)
    # made every method's prefill look faster than it is.
    path = REPO / "results" / "gpu_speed_h200_s4.json"
    if not path.exists():
        pytest.skip("results/gpu_speed_h200_s4.json is not in this checkout")
    result = json.loads(path.read_text())
    from veloxquant_mlx.bench.gpu_speed_figures import summarize_cases
    from veloxquant_mlx.bench.methods import parse_specs, with_reference

    summarize_cases(result["cases"], with_reference(parse_specs([s["name"] for s in result["specs"]])))
    cases = {(c["spec"], c["context"]): c for c in result["cases"]}
    fp16, gear = cases[("fp16", 32768)], cases[("gear", 32768)]
    assert fp16["figure"]["prefill_s"] == min(r["prefill_s"] for r in fp16["runs"]) < 0.5
    assert gear["ratio_vs"]["fp16"]["prefill_time"] == pytest.approx(
        gear["figure"]["prefill_s"] / fp16["figure"]["prefill_s"])
    assert any("gear" in line and "32768" in line for line in table_lines(result["cases"]))


def test_throughput_counts_every_token_where_the_median_token_hides_a_stalling_reference():
    # Session 11/12's fp16 at 128K on the H200: intervals alternating ~1.5 and ~5 ms. Its median
    # token is fast, its throughput (what generate() reports) is not; a steady cache at 2.5 ms
    # loses by the median token and wins by throughput.
    from veloxquant_mlx.bench.gpu_speed_figures import check_targets, summarize_cases
    from veloxquant_mlx.bench.methods import parse_specs, with_reference

    def case(spec, kind, rounds):
        return {"spec": spec, "kind": kind, "context": 131072, "fp16_bytes": 1, "runs": [
            {"prefill_s": 1.0, "decode_tps": None, "cache_bytes_after_prompt": 1}],
            "interleaved": {"rounds": [{"round": i, "intervals_ms": r} for i, r in enumerate(rounds)]}}

    fp16 = case("fp16", "fp16", [[1.5, 5.0, 1.5, 1.5], [5.0, 1.5, 5.0, 1.5]])
    kivi = case("kivi", "ours", [[2.5, 2.5, 2.5, 2.5], [2.5, 2.5, 3.0, 2.5]])
    cases = [fp16, kivi]
    summarize_cases(cases, with_reference(parse_specs(["kivi"])))
    assert kivi["figure"]["decode_tps_throughput"] == pytest.approx(1000 * 8 / 20.5)
    assert fp16["figure"]["decode_tps_throughput"] == pytest.approx(1000 * 8 / 22.5)
    vs = kivi["ratio_vs"]["fp16"]
    assert vs["decode_tps_paired"] == pytest.approx(statistics.median([1.5 / 2.5, 3.25 / 2.5]))
    assert vs["decode_tps_throughput"] == pytest.approx(22.5 / 20.5)
    assert vs["decode_tps_paired_throughput"] == pytest.approx(statistics.median([9.5 / 10.0, 13.0 / 10.5]))
    assert kivi["interleaved"]["throughput_ratio_vs_fp16"]["n"] == 2
    (row,) = [r for r in check_targets(cases) if r["target"].startswith("decode")]
    assert row["throughput_value"] == vs["decode_tps_paired_throughput"] and row["throughput_met"] is True
    assert row["met"] is (vs["decode_tps_paired"] >= 1.0)
    # Runs without interleaved rounds carry no throughput figure (and no such target field).
    assert case_figure({"context": 8, "runs": [_run(1.0, 2.0)]})["decode_tps_throughput"] is None
