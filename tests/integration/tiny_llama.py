"""A tiny random-weight mlx-lm llama and a character tokenizer stub for generate() tests."""

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models import llama


def tiny_llama(n_layers=2, seed=0, vocab=64, hidden=64, heads=4, kv_heads=2, weight_scale=4.0):
    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=n_layers,
        intermediate_size=2 * hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads * 2,  # 32: a multiple of KIVI's group size
        rms_norm_eps=1e-5,
        vocab_size=vocab,
        tie_word_embeddings=True,
    )
    model = llama.Model(args)
    # Scaled-up weights: a random llama at init repeats one token forever; at 4x its greedy
    # path moves through many tokens, so a cache that loses history changes the output.
    model.update(tree_map(lambda p: p * weight_scale if p.ndim == 2 else p, model.parameters()))
    mx.eval(model.parameters())
    return model


class CharTokenizer:
    """Just enough of a tokenizer for mlx_lm.generate with token-id prompts."""

    def __init__(self, vocab=64):
        self.vocab = vocab
        self.eos_token_id = None
        self.eos_token_ids = set()
        self.bos_token = None
        self.chat_template = None

    def convert_tokens_to_ids(self, tokens):
        return [self.get_vocab().get(t) for t in tokens] if isinstance(tokens, list) else self.get_vocab().get(tokens)

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % self.vocab for c in text]

    def apply_chat_template(self, messages, **kwargs):
        raise NotImplementedError("no chat template in the test tokenizer")

    def get_vocab(self):
        return {chr(48 + i): i for i in range(self.vocab)}

    def decode(self, ids, **kwargs):
        return "".join(chr(48 + int(i) % 64) for i in ids)


def greedy_tokens(model, cache=None, *, prompt, n, prefill_step_size=128, **kwargs):
    """The first n greedy tokens mlx-lm's generate_step gives after `prompt` (with `cache` as
    its prompt_cache; None: the model's make_cache, i.e. a patched model's own caches)."""
    from mlx_lm.generate import generate_step

    return [t for t, _ in generate_step(prompt, model, max_tokens=n, prompt_cache=cache,
                                        prefill_step_size=prefill_step_size, **kwargs)]
