"""mlx-lm's batch_generate / BatchGenerator with our caches (cache/batch.py): each sequence of a
batch generates the same greedy tokens as alone, through merge, right-padded prefill, filter
(sequences finishing at different lengths), extend (a sequence joining mid-generation) and
extract; a model our batching cannot serve is refused before any model call."""

import mlx.core as mx
import pytest
from mlx_lm.generate import batch_generate, generate_step

from veloxquant_mlx import KVCacheBuilder, QuantizerConfigError, patch_model_kv_cache, unpatch_model_kv_cache
from veloxquant_mlx.cache.base import CompressedKVCache
from veloxquant_mlx.cache.batch import BatchCompressedKVCache
from tests.architectures.servable import config_for, servable_methods
from tests.architectures.tiny_models import build
from tests.integration.tiny_llama import CharTokenizer

PROMPTS = [[(i * 7 + 3 + k) % 64 for i in range(n)] for k, n in enumerate([300, 37, 170])]
MAX_TOKENS = [12, 5, 9]  # sequences finish at different steps: filter


def _alone(model, prompt, n):
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


def _batched(model, **kwargs):
    return batch_generate(model, CharTokenizer(), PROMPTS, max_tokens=MAX_TOKENS, return_token_ids=True,
                          **kwargs)


@pytest.mark.parametrize("method", servable_methods())
@pytest.mark.parametrize("name", ["llama", "gemma3_text", "nemotron_h"])
def test_each_sequence_matches_its_single_run(name, method, monkeypatch):
    model = build(name)
    seen = {"extend": [], "filter": []}
    for op in seen:
        original = getattr(BatchCompressedKVCache, op)
        monkeypatch.setattr(BatchCompressedKVCache, op, lambda self, arg, _o=original, _op=op: (
            seen[_op].append((self.batch_size, getattr(arg, "batch_size", arg))), _o(self, arg))[1])
    fp16 = [_alone(model, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]
    patch_model_kv_cache(model, config_for(method))
    try:
        alone = [_alone(model, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]
        # completion_batch_size 2: the third sequence joins when the second finishes (extend).
        response = _batched(model, completion_batch_size=2, prefill_batch_size=2, return_prompt_caches=True)
    finally:
        unpatch_model_kv_cache(model)
    assert response.token_ids == alone
    # A generating batch of 1 extended by the sequence that joined; finished ones filtered out.
    assert any(mine > 0 and theirs > 0 for mine, theirs in seen["extend"]), seen
    assert seen["filter"], seen
    if name == "llama":
        assert alone != fp16  # our caches are in the loop
    # extract: each sequence's own cache comes back, holding its prompt and its tokens.
    for prompt, caches, tokens in zip(PROMPTS, response.caches, alone):
        ours = [c for c in caches if isinstance(c, CompressedKVCache)]
        assert ours and all(c.batch_size == 1 for c in ours)
        assert all(len(prompt) + len(tokens) - 1 <= c.offset <= len(prompt) + len(tokens) for c in ours)


def test_given_prompt_caches_are_not_updated_in_place():
    model = build("llama")
    config = config_for("kivi")
    patch_model_kv_cache(model, config)
    try:
        given = []
        for prompt in PROMPTS:
            caches = model.make_cache()
            model(mx.array([prompt[:30]]), cache=caches)  # a prefilled prefix
            given.append(caches)
        offsets = [[c.offset for c in caches] for caches in given]
        nbytes = [[c.nbytes for c in caches] for caches in given]
        rest = [p[30:] for p in PROMPTS]
        response = batch_generate(model, CharTokenizer(), rest, prompt_caches=given, max_tokens=6,
                                  return_token_ids=True)
        alone = []
        for prompt in PROMPTS:
            caches = model.make_cache()
            model(mx.array([prompt[:30]]), cache=caches)
            alone.append([int(t) for t, _ in generate_step(mx.array(prompt[30:]), model, max_tokens=6,
                                                           prompt_cache=caches)])
    finally:
        unpatch_model_kv_cache(model)
    assert [[c.offset for c in caches] for caches in given] == offsets
    assert [[c.nbytes for c in caches] for caches in given] == nbytes
    assert response.token_ids == alone


def test_model_without_the_dispatcher_is_refused_before_any_model_call(monkeypatch):
    # gemma2 computes attention itself: our caches cannot batch there (no silent fp16 fallback).
    model = build("gemma2")
    calls = []
    original = type(model).__call__
    monkeypatch.setattr(type(model), "__call__", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    with pytest.warns(UserWarning, match="gemma2 has no scaled_dot_product_attention"):
        patch_model_kv_cache(model, config_for("kivi"))
    try:
        with pytest.raises(QuantizerConfigError, match=r"batched generation with KIVICache \(layer 0\) needs "
                                                       r"veloxquant's attention dispatcher .*mlx_lm.models.gemma2"):
            _batched(model)
    finally:
        unpatch_model_kv_cache(model)
    assert calls == []


def test_unpatched_model_with_our_caches_is_refused_before_any_model_call():
    model = build("llama")
    given = [KVCacheBuilder.for_model(model, config_for("kivi")) for _ in PROMPTS]
    with pytest.raises(QuantizerConfigError, match="needs veloxquant's attention dispatcher"):
        batch_generate(model, CharTokenizer(), PROMPTS, prompt_caches=given, max_tokens=3)
    assert all(c.empty() for caches in given for c in caches)


def test_merge_refuses_mixed_classes_and_batched_rows():
    model = build("llama")
    patch_model_kv_cache(model, config_for("kivi"))
    try:
        a, b = model.make_cache()[0], model.make_cache()[0]
        batch = BatchCompressedKVCache.merge([a, b])
        assert batch.batch_size == 2 and batch.extract(1) is b  # empty rows are taken as they are
        assert batch.offset.tolist() == [0, 0]
        wide = model.make_cache()
        model(mx.array([[1, 2, 3], [4, 5, 6]]), cache=wide)
        with pytest.raises(QuantizerConfigError, match="entry 0 holds batch=2; allowed is one sequence"):
            BatchCompressedKVCache.merge([wide[0], a])
    finally:
        unpatch_model_kv_cache(model)
