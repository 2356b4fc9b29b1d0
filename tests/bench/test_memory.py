from veloxquant_mlx.bench.memory import fp16_bytes_for, kv_shapes, measure_memory
from veloxquant_mlx.bench.methods import parse_spec
from veloxquant_mlx.bench.speed import random_prompt


def test_fp16_bytes_from_the_model_shape(tiny_model):
    assert kv_shapes(tiny_model) == [(1, 64, 64), (1, 64, 64)]
    # 2 layers x (K + V) x 1 head x 100 tokens x 64 dims x 2 bytes
    assert fp16_bytes_for(tiny_model, 100) == 2 * 2 * 100 * 64 * 2


def test_measured_bytes_follow_the_bits(tiny_model):
    prompt = random_prompt(256, 300)
    rows = {}
    for name in ("fp16", "mlx-q8", "mlx-q4"):
        with parse_spec(name).open(tiny_model) as make_cache:
            rows[name] = measure_memory(tiny_model, make_cache, prompt, prefill_step_size=128)
    assert rows["fp16"]["cache_classes"] == ["KVCache"]
    # float32 model: the unquantized cache holds 4-byte elements plus growth slack (512 slots)
    assert rows["fp16"]["cache_bytes"] == 2 * 2 * 512 * 64 * 4
    assert rows["mlx-q4"]["cache_bytes"] < rows["mlx-q8"]["cache_bytes"] < rows["fp16"]["cache_bytes"]
    assert 0 < rows["mlx-q4"]["ratio_vs_fp16"] < 0.6
    for row in rows.values():
        assert row["tokens"] == 300
        assert row["peak_bytes"] >= row["peak_over_start_bytes"] > 0
        assert row["active_growth_bytes"] >= row["cache_bytes"] * 0.9
