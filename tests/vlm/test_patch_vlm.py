"""patch_vlm_kv_cache on tiny random-weight Qwen2-VL and Gemma3 models: an image plus a text
prompt generates through mlx-vlm's generation loop (see tests/vlm/tiny_vlms.py for why
generate_step and how the inputs are built)."""

import mlx.core as mx
import pytest

pytest.importorskip("mlx_vlm", reason="the vlm extra (mlx-vlm) is not installed")
pytest.importorskip("transformers", reason="mlx-vlm's transformers dependency is missing")

from mlx_vlm.generate.ar import generate_step  # noqa: E402

import veloxquant_mlx.cache.base as cache_base  # noqa: E402
from veloxquant_mlx import KVCacheBuilder, QuantizerConfigError
from veloxquant_mlx.cache.base import CompressedKVCache
from veloxquant_mlx.integration import dispatch, patch_vlm_kv_cache, unpatch_model_kv_cache
from tests.architectures.servable import config_for, decoded_path_matches, servable_methods
from tests.vlm.tiny_vlms import EXPECTED_PLAN, VLMS, make_image

TEXT = [(i * 5 + 3) % 58 + 1 for i in range(300)]  # no pad (0) and no image/vision ids (59..62)
N_NEW = 16


def _generate(model, build_inputs, image, prompt_cache=None):
    input_ids, pixel_values, mask, kwargs = build_inputs(image, TEXT)
    tokens = []
    for token, logprobs in generate_step(input_ids, model, pixel_values, mask, max_tokens=N_NEW,
                                         prompt_cache=prompt_cache, **kwargs):
        assert bool(mx.all(mx.isfinite(logprobs)).item())
        tokens.append(int(token))
    return tokens


def _kinds(caches):
    return ["ours" if isinstance(c, CompressedKVCache) else type(c).__name__ for c in caches]


@pytest.mark.parametrize("method", servable_methods())
@pytest.mark.parametrize("name", list(VLMS))
def test_image_and_text_generate_with_fresh_caches_per_call(name, method):
    make_model, build_inputs = VLMS[name]
    model = make_model()
    config = config_for(method)
    image = make_image()
    # Reference: the unpatched model attending over the K/V our caches decode.
    dequantized = _generate(model, build_inputs, image, KVCacheBuilder.for_model(model.language_model, config))
    try:
        first = patch_vlm_kv_cache(model, config)
        assert _kinds(first) == EXPECTED_PLAN[name]
        # Our attention over the compressed form, installed in mlx-vlm's language module.
        assert f"mlx_vlm.models.{name}.language" in dispatch.installed_modules()
        built = []
        make_cache = model.language_model.make_cache
        object.__setattr__(model.language_model, "make_cache", lambda: built.append(make_cache()) or built[-1])
        one = _generate(model, build_inputs, image)
        two = _generate(model, build_inputs, image)
        other_image = _generate(model, build_inputs, make_image(seed=1))
    finally:
        unpatch_model_kv_cache(model)
    assert len(one) == N_NEW
    assert one == two  # the second call saw none of the first one's state
    if decoded_path_matches(method):
        assert one == dequantized
    assert len(built) == 3 and built[0][1] is not built[1][1]  # mlx-vlm asked once per call
    ours = [c for c in built[0] if isinstance(c, CompressedKVCache)]
    assert ours and all(c.n_compressed > 0 for c in ours)  # the history was compressed
    # The image is in the loop: for the model itself, and through our caches unless the method
    # evicts tokens by score (pyramidkv may drop the 4-16 image tokens of a 300-token prompt).
    assert _generate(model, build_inputs, image) != _generate(model, build_inputs, make_image(seed=1))
    if decoded_path_matches(method):
        assert other_image != one
    assert "make_cache" not in model.language_model.__dict__ and "make_cache" not in model.__dict__


@pytest.mark.parametrize("name", list(VLMS))
def test_standalone_method_refused_before_anything_is_touched(name, monkeypatch):
    model = VLMS[name][0]()
    monkeypatch.setattr(cache_base, "STANDALONE_METHODS", frozenset({"kivi"}))
    before = (dict(model.__dict__), dict(model.language_model.__dict__), dispatch.installed_modules())
    with pytest.raises(QuantizerConfigError, match="'kivi' is a standalone method"):
        patch_vlm_kv_cache(model, config_for("kivi"))
    after = (dict(model.__dict__), dict(model.language_model.__dict__), dispatch.installed_modules())
    assert before == after


@pytest.mark.parametrize("method", servable_methods())
def test_mlx_vlm_generate_with_an_offline_processor(method):
    """mlx_vlm.generate itself (processor, prompt string, PIL image) on the patched Qwen2-VL."""
    import mlx_vlm

    from tests.vlm.tiny_vlms import offline_qwen2_vl_processor, qwen2_vl

    model, processor = qwen2_vl(), offline_qwen2_vl_processor()
    prompt = "look <|vision_start|><|image_pad|><|vision_end|> " + "the quick brown fox. " * 14
    config = config_for(method)

    def run(**kwargs):
        return mlx_vlm.generate(model, processor, prompt, image=[make_image()], max_tokens=N_NEW,
                                temperature=0.0, **kwargs).token_ids

    dequantized = run(prompt_cache=KVCacheBuilder.for_model(model.language_model, config))
    try:
        patch_vlm_kv_cache(model, config)
        built = []
        make_cache = model.language_model.make_cache
        object.__setattr__(model.language_model, "make_cache", lambda: built.append(make_cache()) or built[-1])
        one, two = run(), run()
    finally:
        unpatch_model_kv_cache(model)
    assert 1 <= len(one) <= N_NEW and one == two  # greedy may hit the tokenizer's eos early
    assert len(built) == 2 and built[0][0] is not built[1][0]  # fresh caches per call
    assert all(c.offset > 300 and c.n_compressed > 0 for c in built[0])
    if decoded_path_matches(method):
        assert one == dequantized
