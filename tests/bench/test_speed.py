from veloxquant_mlx.bench.methods import parse_specs, with_reference
from veloxquant_mlx.bench.speed import run_speed
from veloxquant_mlx.bench.tiny import random_llama


def test_run_speed_cases_summaries_and_ratios(tiny_model):
    specs = with_reference(parse_specs(["mlx-q4"]))
    result = run_speed(tiny_model, specs, [96, 32], repeats=2, decode_tokens=4, warmup_tokens=1,
                       prefill_step_size=64, progress=False)
    assert result["settings"]["contexts"] == [32, 96]
    cases = result["cases"]
    assert [(c["spec"], c["context"]) for c in cases] == [
        ("fp16", 32), ("mlx-q4", 32), ("fp16", 96), ("mlx-q4", 96)]
    for case in cases:
        assert "error" not in case and len(case["runs"]) == 2
        assert case["decode_tps"]["min"] <= case["decode_tps"]["median"] <= case["decode_tps"]["max"]
        assert case["runs"][0]["decoded_tokens_timed"] == 4
        assert case["runs"][0]["context"] == case["context"]
    q4 = cases[1]
    expected = q4["decode_tps"]["median"] / cases[0]["decode_tps"]["median"]
    assert abs(q4["ratio_vs"]["fp16"]["decode_tps"] - expected) < 1e-12
    assert cases[0]["ratio_vs"] == {}


def test_a_failing_spec_is_recorded_and_the_run_continues():
    # head_dim 32 cannot be quantized in groups of 64: mlx-q4 fails, fp16 still runs.
    model = random_llama(hidden=64, layers=1, heads=2, kv_heads=1, head_dim=32, intermediate=64, vocab=64)
    result = run_speed(model, with_reference(parse_specs(["mlx-q4"])), [16], repeats=1,
                       decode_tokens=2, warmup_tokens=0, progress=False)
    fp16, q4 = result["cases"]
    assert "error" not in fp16 and fp16["decode_tps"]["median"] > 0
    assert q4["error"].startswith("warm-up failed:") and q4["runs"] == []
    assert q4["decode_tps"]["median"] is None and q4["ratio_vs"]["fp16"]["decode_tps"] is None


def test_measure_case_leaves_the_last_decoded_token_untimed(tiny_model, monkeypatch):
    # The last token read has no step queued behind it, so its interval is short (not steady
    # state): measure_case decodes one token past the timed ones and never times that one.
    from mlx_lm.models.cache import make_prompt_cache

    from veloxquant_mlx.bench import speed
    from veloxquant_mlx.bench.drive import DecodeTrace

    asked = []

    def fake_decode(model, cache, logits, n_tokens):
        asked.append(n_tokens)
        # warm-up intervals 0.5 s, steady 0.1 s, the tail 0.01 s
        steps = [0.5] * 2 + [0.1] * (n_tokens - 4) + [0.01]
        times = [0.0]
        for step in steps:
            times.append(times[-1] + step)
        return DecodeTrace(tokens=[0] * n_tokens, times=times)

    monkeypatch.setattr(speed, "decode", fake_decode)
    prompt = speed.random_prompt(256, 8)
    result = speed.measure_case(tiny_model, lambda: make_prompt_cache(tiny_model), prompt,
                                decode_tokens=5, warmup_tokens=2)
    assert asked == [2 + 5 + 2]
    assert result["decoded_tokens_timed"] == 5
    assert abs(result["decode_interval_ms_min"] - 100) < 1e-6
    assert abs(result["decode_interval_ms_max"] - 100) < 1e-6
    assert abs(result["decode_tps"] - 10) < 1e-6
