"""bench.kernel_probe as cases: the JSON is rewritten after every case, a failing case is recorded
and the next runs, --budget-s stops starting cases; the prefill and step cases run on the CPU
(the CUDA check patched out) with tiny sizes."""

import json
import time

from veloxquant_mlx.bench import kernel_probe
from veloxquant_mlx.bench.kernel_probe import Case, run_cases


def _put(key):
    return lambda rows, value: rows.__setitem__(key, value)


def test_each_case_is_saved_as_it_finishes_and_a_failure_does_not_stop_the_rest():
    saved, logged = [], []

    def boom():
        raise RuntimeError("no such kernel")

    result = {"settings": {}}
    cases = [Case("a", lambda: 1, _put("a")), Case("b", boom, _put("b")), Case("c", lambda: {"x": 3}, _put("c"))]
    run_cases(cases, result, budget_s=None, save=lambda: saved.append(json.dumps(result)), log=logged.append)
    assert result["results"] == {"a": 1, "c": {"x": 3}}
    assert [(c["case"], c["status"]) for c in result["cases"]] == [("a", "done"), ("b", "error"), ("c", "done")]
    assert result["cases"][1]["error"].startswith("RuntimeError: no such kernel")
    # The file after the first case already held it (one save per case, then a last one).
    first = json.loads(saved[0])
    assert first["results"] == {"a": 1} and [c["case"] for c in first["cases"]] == ["a"]
    assert len(saved) == 4 and all(c["seconds"] >= 0 for c in result["cases"])
    assert logged[0].startswith("a: done in") and "no such kernel" in logged[1]


def test_the_budget_stops_new_cases_and_records_them_as_skipped():
    result = {}
    slow = Case("slow", lambda: time.sleep(0.05) or "ok", _put("slow"))
    run_cases([slow, Case("next", lambda: 2, _put("next")), Case("last", lambda: 3, _put("last"))], result,
              budget_s=0.01, save=lambda: None, log=lambda m: None)
    assert result["results"] == {"slow": "ok"}
    assert [c["status"] for c in result["cases"]] == ["done", "skipped", "skipped"]
    assert result["cases"][1]["reason"].startswith("budget: ") and "--budget-s 0.01" in result["cases"][1]["reason"]


def test_prefill_and_step_cases_run_end_to_end_on_the_cpu(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(kernel_probe, "on_cuda", lambda: True)
    out = tmp_path / "k.json"
    assert kernel_probe.main(["--parts", "prefill,step", "--contexts", "64", "--methods", "fp16,kivi",
                              "--prefill-context", "128", "--prefill-chunk", "64", "--fills", "1",
                              "--budget-s", "600", "--no-openblas", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [c["case"] for c in result["cases"]] == ["prefill 128 fp16", "prefill 128 kivi", "step 64 fp16", "step 64 kivi"]
    assert all(c["status"] == "done" for c in result["cases"]), result["cases"]
    prefill = result["results"]["prefill"]
    assert prefill["tokens"] == 128 and prefill["chunk"] == 64 and set(prefill["fills"]) == {"fp16", "kivi"}
    assert set(prefill["last_chunk_ms"]) == {"kivi"} and prefill["last_chunk_ms"]["kivi"]["fused_attention"] > 0
    step = result["results"]["step"]["64"]
    assert step["fp16_step_ms"] > 0 and step["kivi_step_ms"] > 0
    assert result["command"] and result["settings"]["budget_s"] == 600
    assert "step 64 kivi: done in" in capsys.readouterr().err
