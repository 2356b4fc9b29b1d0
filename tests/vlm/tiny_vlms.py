"""Tiny random-weight mlx-vlm models built from their configs (no hub, no weights), and their
image inputs built from a PIL image generated here.

No processor: mlx-vlm's `generate` needs a hub processor (tokenizer + image processor + chat
template), so the tests drive mlx-vlm's own generation loop, `mlx_vlm.generate.ar.generate_step`
(what `mlx_vlm.generate` / `stream_generate` call), with input_ids that hold the model's image
tokens and pixel_values made from the image: for Qwen2-VL by transformers'
Qwen2VLImageProcessor (offline, numpy), for Gemma3 by SigLIP's normalisation ((x - 0.5) / 0.5,
channels first) done here.
"""

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map
from PIL import Image

VOCAB = 64


def _scaled(model, seed_scale=3.0):
    # Scaled-up random weights: the greedy path moves through many tokens.
    model.update(tree_map(lambda p: p * seed_scale if p.ndim == 2 else p, model.parameters()))
    mx.eval(model.parameters())
    return model


def make_image(seed=0, size=56):
    pixels = np.random.default_rng(seed).random((size, size, 3)) * 255
    return Image.fromarray(pixels.astype(np.uint8))


def qwen2_vl(seed=0):
    from mlx_vlm.models.qwen2_vl import Model, ModelConfig, TextConfig, VisionConfig

    text = TextConfig(model_type="qwen2_vl", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                      num_attention_heads=2, rms_norm_eps=1e-6, vocab_size=VOCAB, num_key_value_heads=1,
                      rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]})
    vision = VisionConfig(model_type="qwen2_vl", depth=1, embed_dim=32, hidden_size=64, num_heads=2,
                          patch_size=14, spatial_patch_size=14)
    config = ModelConfig(text_config=text, vision_config=vision, model_type="qwen2_vl", image_token_id=60,
                         video_token_id=61, vision_start_token_id=59, vocab_size=VOCAB)
    mx.random.seed(seed)
    return _scaled(Model(config))


def qwen2_vl_inputs(image, text_ids):
    """input_ids with <vision_start> + one image token per merged 2x2 patch, pixel_values, kwargs."""
    from transformers import Qwen2VLImageProcessor

    side = image.size[0] * image.size[1]
    processed = Qwen2VLImageProcessor(min_pixels=side, max_pixels=side)(images=[image], return_tensors="np")
    grid = processed["image_grid_thw"]
    n_image_tokens = int(np.prod(grid[0])) // 4  # spatial_merge_size 2
    ids = [1, 2, 59] + [60] * n_image_tokens + list(text_ids)
    return (mx.array([ids]), mx.array(processed["pixel_values"]), None,
            {"image_grid_thw": mx.array(grid)})


def gemma3(seed=0):
    from mlx_vlm.models.gemma3 import Model, ModelConfig, TextConfig, VisionConfig

    text = TextConfig(model_type="gemma3_text", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
                      num_attention_heads=2, head_dim=32, vocab_size=VOCAB, num_key_value_heads=1,
                      query_pre_attn_scalar=32, sliding_window=16, sliding_window_pattern=2,
                      mm_tokens_per_image=4)
    vision = VisionConfig(model_type="siglip_vision_model", num_hidden_layers=1, hidden_size=32,
                          intermediate_size=64, num_attention_heads=2, patch_size=14, image_size=56)
    config = ModelConfig(text_config=text, vision_config=vision, model_type="gemma3", vocab_size=VOCAB,
                         image_token_index=62, hidden_size=64, pad_token_id=0)
    mx.random.seed(seed)
    return _scaled(Model(config))


def gemma3_inputs(image, text_ids):
    """input_ids with mm_tokens_per_image (4) image tokens, SigLIP-normalised pixels, a mask."""
    pixels = (np.asarray(image, dtype=np.float32) / 255.0 - 0.5) / 0.5
    ids = [1, 2] + [62] * 4 + list(text_ids)
    return (mx.array([ids]), mx.array(pixels.transpose(2, 0, 1)[None]),
            mx.ones((1, len(ids)), dtype=mx.int32), {})


VLMS = {"qwen2_vl": (qwen2_vl, qwen2_vl_inputs), "gemma3": (gemma3, gemma3_inputs)}
# What each language-model cache entry gets ("ours" for our cache).
EXPECTED_PLAN = {
    "qwen2_vl": ["ours", "ours"],
    "gemma3": ["RotatingKVCache", "ours", "RotatingKVCache", "ours"],
}


def offline_qwen2_vl_processor():
    """A Qwen2-VL processor for `mlx_vlm.generate` without the hub: a character-level WordLevel
    tokenizer (ids < VOCAB, the vision specials at the config's ids 59..62), transformers'
    Qwen2VLImageProcessor (numpy/PIL backend) sized for the 56x56 test image, mlx-vlm's own
    torch-free Qwen2VLProcessor, and the detokenizer / stopping criteria mlx-vlm's
    load_processor would attach."""
    from mlx_vlm.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor
    from mlx_vlm.tokenizer_utils import NaiveStreamingDetokenizer
    from mlx_vlm.utils import StoppingCriteria
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2VLImageProcessor

    characters = [chr(97 + i) for i in range(26)] + [chr(65 + i) for i in range(26)] + [" ", ".", ","]
    vocab = {c: i + 1 for i, c in enumerate(characters)}  # 1..55
    vocab.update({"<unk>": 56, "<eos>": 57, "<pad>": 58, "<|vision_start|>": 59, "<|image_pad|>": 60,
                  "<|video_pad|>": 61, "<|vision_end|>": 62})
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>", pad_token="<pad>",
        additional_special_tokens=["<|vision_start|>", "<|image_pad|>", "<|video_pad|>", "<|vision_end|>"])
    side = 56 * 56
    processor = Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(min_pixels=side, max_pixels=side),
                                 tokenizer=tokenizer, video_processor=None, chat_template=None)
    processor.detokenizer = NaiveStreamingDetokenizer(tokenizer)
    tokenizer.stopping_criteria = StoppingCriteria([tokenizer.eos_token_id], tokenizer)
    return processor
