"""gpu_speed --interleave on the CPU, tiny shapes: every spec's cache alive, decode in rounds with
a rotating order, per-round ratios to fp16, one dispatcher held throughout, a spec failing
mid-way leaves the rounds while the others go on, and the budget stops rounds."""

import json
import statistics

from tests.bench.test_gpu_speed import TINY
from veloxquant_mlx.bench import gpu_speed, gpu_speed_interleave
from veloxquant_mlx.cache.kivi import KIVICache
from veloxquant_mlx.integration import dispatch


def _interleaved(tmp_path, methods, *extra):
    out = tmp_path / "g.json"
    # --quick: 8 decode tokens; 2 per round -> 4 rounds, one repeat.
    assert gpu_speed.main(["--quick", *TINY, "--contexts", "64", "--methods", methods, "--prefill-step-size", "32",
                           "--interleave", "--round-tokens", "2", *extra, "--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_rounds_rotate_and_ratios_pair_each_round_with_fp16(tmp_path):
    result = _interleaved(tmp_path, "fp16,kivi,xquant", "--context-warmup")
    assert result["settings"]["interleave"] and result["settings"]["rounds"] == 4
    assert set(result["context_warmup"]["64"]) == {"fp16", "kivi", "xquant"}
    cases = {c["spec"]: c for c in result["cases"]}
    names = ["fp16", "kivi", "xquant"]
    for name, case in cases.items():
        assert "error" not in case and len(case["runs"]) == 1 and case["runs"][0]["decode_tps"] is None
        rounds = case["interleaved"]["rounds"]
        assert [r["round"] for r in rounds] == [0, 1, 2, 3]
        assert all(len(r["intervals_ms"]) == 2 and min(r["intervals_ms"]) > 0 for r in rounds)
        # Round r starts at spec r % 3: each spec runs first, second and third.
        assert [r["position"] for r in rounds] == [(names.index(name) - r) % 3 for r in range(4)]
        fig = case["figure"]
        assert fig["decode_source"] == "interleaved rounds" and fig["prefill_may_be_cold"] is False
        tokens = [ms for r in rounds for ms in r["intervals_ms"]]
        assert fig["decode_tps"] == 1000 / statistics.median(tokens)
    fp16_rounds = [statistics.median(r["intervals_ms"]) for r in cases["fp16"]["interleaved"]["rounds"]]
    kivi_rounds = [statistics.median(r["intervals_ms"]) for r in cases["kivi"]["interleaved"]["rounds"]]
    ratios = [f / k for f, k in zip(fp16_rounds, kivi_rounds)]
    paired = cases["kivi"]["interleaved"]["ratio_vs_fp16"]
    assert paired["n"] == 4 and paired["median"] == statistics.median(ratios)
    assert paired["min"] == min(ratios) and paired["max"] == max(ratios)
    assert cases["kivi"]["ratio_vs"]["fp16"]["decode_tps_paired"] == paired["median"]
    assert "ratio_vs_fp16" not in cases["fp16"]["interleaved"]
    assert dispatch.installed_modules() == []  # the held dispatcher is released
    # Plotted from the figures (the runs hold no decode figure of their own here).
    from veloxquant_mlx.bench import report

    assert report.plot_speed(result, tmp_path / "g_speed.png").read_bytes()[:4] == b"\x89PNG"


def test_a_spec_failing_mid_way_leaves_the_rounds_and_one_dispatcher_serves_them(tmp_path, monkeypatch):
    real = gpu_speed_interleave.decode_burst
    kivi_calls, dispatchers = [], set()

    def burst(model, cache, logits, tokens):
        if isinstance(cache[0], KIVICache):
            kivi_calls.append(tokens)
            if kivi_calls[1:]:  # after the warm-up burst the caches have attended: the dispatcher is set
                dispatchers.add(id(cache[0]._dispatcher))
                assert cache[0]._dispatcher.installed
            if len(kivi_calls) == 3:  # warm-up, round 1, then round 2 fails
                raise RuntimeError("injected failure in round 2")
        return real(model, cache, logits, tokens)

    monkeypatch.setattr(gpu_speed_interleave, "decode_burst", burst)
    result = _interleaved(tmp_path, "fp16,kivi,gear")
    cases = {c["spec"]: c for c in result["cases"]}
    assert cases["kivi"]["error"].startswith("decode round 2: RuntimeError: injected failure in round 2")
    assert [r["round"] for r in cases["kivi"]["interleaved"]["rounds"]] == [0]
    assert cases["kivi"]["interleaved"]["ratio_vs_fp16"]["n"] == 1
    for name in ("fp16", "gear"):
        assert "error" not in cases[name] and len(cases[name]["interleaved"]["rounds"]) == 4
    assert cases["gear"]["interleaved"]["ratio_vs_fp16"]["n"] == 4
    assert len(dispatchers) == 1 and dispatch.installed_modules() == []


def test_the_budget_stops_rounds_and_is_recorded(tiny_model):
    from veloxquant_mlx.bench.methods import parse_specs
    from veloxquant_mlx.bench.speed import random_prompt

    specs = parse_specs(["fp16", "kivi"])
    cases = {s.name: {"spec": s.name, "kind": s.kind, "context": 48, "runs": []} for s in specs}
    checks = []

    def over_budget():  # spent after the second round's check
        checks.append(1)
        return "budget: test" if len(checks) > 2 else None

    gpu_speed_interleave.run_context(
        tiny_model, specs, random_prompt(256, 48), cases, repeats=2, rounds=5, round_tokens=1, warmup_tokens=1,
        prefill_step_size=16, may_start=lambda spec, case, what: True, over_budget=over_budget,
        save=lambda: None, log=lambda message: None)
    for case in cases.values():
        assert len(case["runs"]) == 2  # both prefill repeats; the last one's cache was decoded
        assert [r["round"] for r in case["interleaved"]["rounds"]] == [0, 1]
        assert case["interleaved"]["skipped"] == "budget: test (rounds 3-5 of 5 not run)"


def test_an_ablation_spec_is_timed_beside_its_method_and_recomputes(tmp_path, monkeypatch):
    # bench/ablations.py's kivi-inplace: kivi's caches, the decode window written in place.
    from veloxquant_mlx.cache import window_buffer

    calls = []
    append = window_buffer.append_token
    monkeypatch.setattr(window_buffer, "append_token", lambda *a: calls.append(1) or append(*a))
    result = _interleaved(tmp_path, "fp16,kivi:kivi_residual_length=16,kivi-inplace:kivi_residual_length=16")
    cases = {c["spec"]: c for c in result["cases"]}
    inplace = cases["kivi-inplace:kivi_residual_length=16"]
    assert inplace["kind"] == "ablation" and "error" not in inplace and len(inplace["interleaved"]["rounds"]) == 4
    assert inplace["ratio_vs"]["fp16"]["decode_tps_paired"] > 0
    assert calls  # its decode steps wrote in place
    # the saved file re-derives with the ablation's spec parsed again
    path = tmp_path / "g.json"
    assert gpu_speed.recompute(str(path))["cases"][1]["spec"] == "kivi:kivi_residual_length=16"
