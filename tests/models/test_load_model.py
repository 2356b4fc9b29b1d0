"""load_model: None -> the embedded SmolLM2; a path -> mlx_lm.load of an mlx-lm model directory."""

import json

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import llama

from veloxquant_mlx.models import load_model

pytestmark = pytest.mark.model


def test_none_loads_smollm2(smollm2):
    model, tokenizer = load_model(None)
    assert isinstance(model, llama.Model) and model.args.num_hidden_layers == 30
    assert tokenizer.encode("Hello world") == smollm2[1].encode("Hello world")


def test_a_directory_goes_through_mlx_lm_load(smollm2, tmp_path):
    # A tiny random llama saved as an mlx-lm directory, with the SmolLM2 tokenizer.
    _, tokenizer = smollm2
    config = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=49152,
                  tie_word_embeddings=True)
    mx.random.seed(1)
    model = llama.Model(llama.ModelArgs(**config))
    mx.save_safetensors(str(tmp_path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (tmp_path / "config.json").write_text(json.dumps(config))
    tokenizer._tokenizer.save_pretrained(str(tmp_path))

    loaded, loaded_tok = load_model(tmp_path)
    ids = mx.array([tokenizer.encode("It is a truth universally acknowledged")])
    assert mx.allclose(loaded(ids), model(ids), atol=1e-5).item()
    assert loaded_tok.encode("It is a truth 1813") == tokenizer.encode("It is a truth 1813")
