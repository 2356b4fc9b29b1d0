"""Reason templates render facts only (null as "unknown"); the benchmark module runs."""

import pytest

from veloxquant_mlx.policy.templates import TemplateError, compile_template, render, template_facts


def test_render_facts_and_null():
    pieces = compile_template("pressure {pressure_fraction:.0%} at {seq_len:,} tokens, {{literal}}")
    assert template_facts(pieces) == ("pressure_fraction", "seq_len")
    assert render(pieces, {"pressure_fraction": 0.5, "seq_len": 64000}) == "pressure 50% at 64,000 tokens, {literal}"
    assert render(pieces, {"pressure_fraction": None, "seq_len": 1}) == "pressure unknown at 1 tokens, {literal}"


@pytest.mark.parametrize("text", ["{seq_len.__class__.__mro__}", "{seq_len[0]}", "{__import__}",
                                  "{seq_len:{head_dim}}", "{seq_len!s}", "{}", "{1}", "{seq_len", "}"])
def test_refused_templates(text):
    with pytest.raises(TemplateError):
        compile_template(text)


def test_perf_module_runs_quickly():
    from veloxquant_mlx.policy import perf

    decision = perf.bench_decision(repeats=2, loops=20)
    assert decision["select_kv_cache_config"]["median"] > 0
    assert perf.bench_lint(repeats=1)["n"] == 1
    assert perf.machine()["cpu_count"] >= 1
