"""A Hugging Face fast tokenizer rebuilt from a GGUF file's ``tokenizer.ggml.*`` metadata.

Only the byte-level BPE family (``tokenizer.ggml.model == 'gpt2'``) is supported. The
pre-tokenizer follows llama.cpp's pre-tokenizer name (``tokenizer.ggml.pre``); for "smollm"
(SmolLM / SmolLM2) that is what the original tokenizer.json holds: every digit split on its own,
then GPT-2's byte-level regex split, no prefix space. The result is wrapped in mlx-lm's
``TokenizerWrapper`` with the byte-level streaming detokenizer, so ``mlx_lm.generate`` and
``mlx_lm.stream_generate`` accept it.
"""

from __future__ import annotations

from typing import Any, Mapping

import mlx.core as mx
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

# llama.cpp token types (llama_token_type): 1 normal, 2 unknown, 3 control, 4 user defined.
_CONTROL_TYPES = (2, 3)
_USER_DEFINED = 4


def _pre_tokenizer(pre: str):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("gpt2", "default"):
        return byte_level
    raise ValueError(f"tokenizer.ggml.pre is {pre!r}; supported: 'smollm', 'gpt2', 'default'")


def _token_id(metadata: Mapping[str, Any], key: str):
    value = metadata.get(key)
    if value is None:
        return None
    return int(value.item()) if isinstance(value, mx.array) else int(value)


def tokenizer_from_gguf(metadata: Mapping[str, Any]) -> Tokenizer:
    """A ``tokenizers.Tokenizer`` from the GGUF vocabulary, merges and token types."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"tokenizer.ggml.model is {kind!r}; only byte-level BPE ('gpt2') is supported")
    tokens = list(metadata["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("tokenizer.ggml.tokens holds duplicate tokens")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(metadata.get("tokenizer.ggml.pre", "default"))
    tok.decoder = decoders.ByteLevel()
    types = metadata.get("tokenizer.ggml.token_type")
    if types is not None:
        types = types.tolist()
        specials = [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t in _CONTROL_TYPES]
        users = [AddedToken(tokens[i], special=False, normalized=False) for i, t in enumerate(types) if t == _USER_DEFINED]
        tok.add_special_tokens(specials)
        if users:
            tok.add_tokens(users)
    return tok


def tokenizer_wrapper_from_gguf(metadata: Mapping[str, Any]):
    """mlx-lm ``TokenizerWrapper`` around a transformers fast tokenizer built from the GGUF."""
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper
    from transformers import PreTrainedTokenizerFast

    tokens = metadata["tokenizer.ggml.tokens"]
    special = {}
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding")):
        idx = _token_id(metadata, f"tokenizer.ggml.{key}_token_id")
        if idx is not None:
            special[name] = tokens[idx]
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer_from_gguf(metadata),
        chat_template=metadata.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
        **special,
    )
    # add_bos_token is False for SmolLM2 (GGUF tokenizer.ggml.add_bos_token); the tokenizers
    # object has no post-processor, so nothing is prepended. A model that wants a BOS would need
    # a TemplateProcessing post-processor: refuse rather than tokenize silently without it.
    add_bos = metadata.get("tokenizer.ggml.add_bos_token")
    if add_bos is not None and bool(add_bos.item() if isinstance(add_bos, mx.array) else add_bos):
        raise ValueError("tokenizer.ggml.add_bos_token is true; this builder does not add a BOS token")
    # <|endoftext|> ends a document in the pretraining data: stop there too, not only at eos.
    eos_ids = {i for i in (_token_id(metadata, "tokenizer.ggml.eos_token_id"),) if i is not None}
    if tokens and tokens[0] == "<|endoftext|>":
        eos_ids.add(0)
    return TokenizerWrapper(hf, detokenizer_class=BPEStreamingDetokenizer, eos_token_ids=sorted(eos_ids))
