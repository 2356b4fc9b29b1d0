import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from veloxquant_mlx.bench.drive import decode, prefill
from veloxquant_mlx.bench.speed import random_prompt


def test_chunked_prefill_matches_one_call(tiny_model):
    prompt = random_prompt(256, 50, seed=1)
    whole = tiny_model(prompt[None], cache=make_prompt_cache(tiny_model))[:, -1, :]
    cache = make_prompt_cache(tiny_model)
    chunked = prefill(tiny_model, cache, prompt, prefill_step_size=16)
    assert cache[0].offset == 50
    assert mx.allclose(whole, chunked, atol=1e-4).item()


def test_decode_greedy_and_forced(tiny_model):
    prompt = random_prompt(256, 20, seed=2)
    cache = make_prompt_cache(tiny_model)
    trace = decode(tiny_model, cache, prefill(tiny_model, cache, prompt), 6, keep_logits=True)
    assert len(trace.tokens) == len(trace.times) == len(trace.logits) == 6
    assert cache[0].offset == 20 + 5  # the last token is never fed back
    assert trace.tokens[0] == int(mx.argmax(trace.logits[0], axis=-1).item())
    assert len(trace.intervals(skip=2)) == 3 and all(t >= 0 for t in trace.intervals())
    cache2 = make_prompt_cache(tiny_model)
    forced = decode(tiny_model, cache2, prefill(tiny_model, cache2, prompt), 6, forced_tokens=trace.tokens)
    assert forced.tokens == trace.tokens


def test_prefill_refuses_bad_input(tiny_model):
    with pytest.raises(ValueError, match="1-D"):
        prefill(tiny_model, make_prompt_cache(tiny_model), mx.zeros((1, 4), mx.int32))
    with pytest.raises(ValueError, match="prefill_step_size"):
        prefill(tiny_model, make_prompt_cache(tiny_model), mx.zeros((4,), mx.int32), 0)
