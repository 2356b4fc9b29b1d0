"""KIVI: asymmetric low-bit KV cache quantization.

Liu, Yuan, Jin, Zhong, Xu, Braverman, Chen, Hu. "KIVI: A Tuning-Free Asymmetric 2bit
Quantization for KV Cache", ICML 2024, arXiv:2402.02750.

What the paper does and what this cache stores:
- Keys are quantized per channel: each channel (a coordinate of head_dim) is quantized in groups
  of `kivi_group_size` consecutive tokens, because key outliers sit in fixed channels. We store
  K^T, shape (B, H, head_dim, tokens), quantized with `mx.quantize` along the token axis
  (asymmetric affine: uint32-packed codes, one scale and one bias per group).
- Values are quantized per token, in groups of `kivi_group_size` along head_dim: shape
  (B, H, tokens, value_dim) quantized along value_dim.
- The most recent `kivi_residual_length` tokens stay exact (the paper's residual R), plus the
  not yet full group of keys (the paper's "streaming" part); whole groups leave the window
  once more than R tokens are exact.
- Attention never dequantizes the history: scores = quantized_matmul(q, K^T codes, transpose=
  False) and out = quantized_matmul(p, V codes, transpose=False), the two products the paper's
  fused kernels compute, plus exact attention over the window, under one softmax (the base). On
  the CPU the scores take float32 queries and the values are read as planes for BLAS products
  (cache/split_reduction.py -> cache/unpacked_products.py): MLX's CPU kernels are slower there.

- The first token of the sequence (the attention sink, `exact_sink_tokens`) is kept exact
  beside the store, (B, H, 1, D) in the input dtype; see the deviations.

Bits: `bit_width_inlier` (2, 3, 4 or 8; per layer from a list), or `key_bits` / `value_bits`
when set, so keys and values can get different widths.

Deviations from the paper:
- The attention sink is exact (not in the paper; StreamingLLM, KVQuant and our turboquant_rvq
  do the same). Token 0 receives most of the attention mass and its key is an outlier; per
  channel quantization in groups of G tokens let it widen the range of every channel's first
  group, so tokens 0..G-1 all erred. Now, when the first group is encoded, token 0's exact K/V
  are set aside and the group quantizes a copy of token 1 in its place; attention scores
  column 0 with the exact key and weighs the exact value there (the placeholder codes are
  never read), under the same one softmax; `_decode` returns the exact token 0, and the CUDA
  decode kernels are told to skip column 0 and attend the exact sink like the window
  (fused_decode.decode_step's skip / exact_prefix). On SmolLM2 (DESIGN.md protocol,
  results/kivi_quality.json -> results/kivi_quality_sink.json) kivi-2 went from KL 0.105 /
  top-1 83.6% / PPL 17.43 to KL 0.059 / top-1 87.5% / PPL 17.02 (fp16 cache: 16.52), and
  kivi-4 from KL 0.0024 / 97.1% to 0.0007 / 98.4%, for 2 x head_dim input-dtype values per
  kv head and layer (nbytes counts them; bits_per_element does not, like the window).
  What is left at 2 bits is mostly the keys': with the sink, 4-bit keys and 2-bit values give
  KL 0.0049 / top-1 96.4%, 2-bit keys and 4-bit values 0.0445 / 88.8%
  (results/kivi_quality_sink_split.json). Cost on the CPU: one layer's decode step at 4096
  tokens (SmolLM2's shape, fp32) took 2.44-2.51 ms median against 2.39-2.49 ms without the
  sink (+1-2%; two interleaved runs, loaded 2-core VM). Trimming into the first group decodes
  it (the exact sink included) back into the window; it is set aside again when re-encoded.
- Scales and biases are stored in float16 (bfloat16 for a bfloat16 model) even when the model
  runs in float32: this halves the side data (1 bit per element instead of 2 at group 32) and its
  rounding error (~5e-4 relative) is far below the 2-bit quantization error.
- Values leave the exact window in whole groups of `kivi_group_size` tokens, like keys (the paper
  quantizes each value token as soon as it leaves the residual window). So between R and
  R + group - 1 tokens are exact, never fewer than R.
- The rounding is the paper's (scale = range / (2^bits - 1), zero point = group minimum, round
  to nearest: error <= scale / 2), computed here and packed in mx.quantize's layout; we do not
  call mx.quantize, whose rounding keeps zero exactly representable and so errs up to one whole
  step. The paper's CUDA kernels are replaced by `mx.quantized_matmul`, which runs on CPU, CUDA
  and Metal.
- Prefill chunks (>= CompressedKVCache.prefill_rows query rows) attend over the history
  decoded transiently, one layer at a time, with the fused mx.fast attention: the same numbers
  as the compressed products (tests check it), ~10x faster on the CPU, and one layer's decoded
  history is small next to a chunk's score matrix. On CUDA that K/V (sink, decoded history,
  window) is written by one kernel in the queries' dtype (cache/fused_prefill_affine.py, session
  5; bit-identical to the portable path under the CPU emulation, not yet timed on a GPU) instead
  of a dequantize, a transpose and two concatenations; and the blocks leaving the window are
  encoded by one kernel too (cache/fused_encode_affine.py, the same bits as
  compiled_affine_quantize under the emulation). Decode steps always
  read the compressed form (quantized_matmul); the history is never decoded there.
- Scales' dtype: mx.quantized_matmul takes float32 queries with float16 scales and biases
  (checked on CPU); the speed was the same as with float32 side data in our measurement.
- value_dim must be a multiple of the group size (the paper's setting: head_dim 128, group 32);
  a layer that does not fit is refused rather than padded.
"""

from __future__ import annotations

from fractions import Fraction
from functools import lru_cache

import mlx.core as mx
import numpy as np

from veloxquant_mlx.cache import fused_decode, fused_encode_affine, fused_prefill_affine
from veloxquant_mlx.cache.base import CompressedKVCache, StoreArray
from veloxquant_mlx.cache.sink import with_sink_placeholder
from veloxquant_mlx.cache.sign_plane import compute_dtype
from veloxquant_mlx.cache.split_reduction import quantized_weighted_sum
from veloxquant_mlx.errors import QuantizerConfigError


def _stream_shifts(bits: int):
    """Shift tables that place 32 codes of `bits` bits into `bits` uint32 words as one
    little-endian bit stream (code i at stream bit bits*i): the layout mx.quantize writes and
    mx.quantized_matmul reads, for every width (a 3-bit code may straddle two words)."""
    start = bits * np.arange(32)[None, :] - 32 * np.arange(bits)[:, None]  # (words, codes)
    low = (start >= 0) & (start < 32)  # the code's low bits land in this word
    high = (start < 0) & (start > -bits)  # its high bits spill over into this word
    return (
        mx.array(low), mx.array(np.clip(start, 0, 31).astype(np.uint32)),
        mx.array(high), mx.array(np.clip(-start, 0, 31).astype(np.uint32)),
    )


def pack_stream(codes: mx.array, bits: int) -> mx.array:
    """uint32 codes (..., n), n a multiple of 32, each < 2**bits -> (..., n * bits / 32) words."""
    low, low_shift, high, high_shift = _stream_shifts(bits)
    n = codes.shape[-1]
    grouped = codes.reshape(*codes.shape[:-1], n // 32, 1, 32)
    parts = mx.where(low, mx.left_shift(grouped, low_shift), 0) + mx.where(
        high, mx.right_shift(grouped, high_shift), 0
    )
    # Parts of one word occupy disjoint bits, so their sum is their bitwise or.
    words = mx.sum(parts.astype(mx.uint32), axis=-1).astype(mx.uint32)
    return words.reshape(*codes.shape[:-1], n * bits // 32)


def affine_quantize(x: mx.array, group_size: int, bits: int, side_dtype: mx.Dtype):
    """KIVI's asymmetric round-to-nearest along the last axis, in groups: scale = (max - min) /
    (2**bits - 1), zero point = min, codes round((x - min) / scale). Scales and biases are
    rounded to `side_dtype` first and the codes computed against the rounded values, so the
    error of every element is at most half its group's stored scale (plus the clip of the rare
    element past a scale rounded down). Returns (packed codes, scales, biases) in
    mx.quantized_matmul's format."""
    levels = 2**bits - 1
    groups = x.astype(mx.float32).reshape(*x.shape[:-1], x.shape[-1] // group_size, group_size)
    low = groups.min(axis=-1, keepdims=True)
    high = groups.max(axis=-1, keepdims=True)
    scales = ((high - low) / levels).astype(side_dtype)
    biases = low.astype(side_dtype)
    scale32 = scales.astype(mx.float32)
    safe = mx.where(scale32 > 0, scale32, 1.0)
    codes = mx.clip(mx.round((groups - biases.astype(mx.float32)) / safe), 0, levels)
    codes = codes.astype(mx.uint32).reshape(x.shape)
    return pack_stream(codes, bits), scales.squeeze(-1), biases.squeeze(-1)


@lru_cache(maxsize=None)
def compiled_affine_quantize(group_size: int, bits: int, side_dtype: mx.Dtype):
    """affine_quantize for one setting, through mx.compile: its ~25 elementwise ops (min/max,
    rounding, the bit-stream packing) fuse into a few kernels. On the H200 the unfused ops took
    0.72 ms per 2048-token prefill chunk of one layer (K and V), a third of the gap between
    kivi's and the fp16 cache's prefill; the codes are bit-identical (tests check it)."""
    return mx.compile(lambda x: affine_quantize(x, group_size, bits, side_dtype))


def _tokens_per_word(bits: int):
    # 16 two-bit codes per uint32 word; 32/3 three-bit codes (mx.quantize packs 3-bit codes
    # across word boundaries), hence a Fraction: a whole group of 32 tokens is always 3 words.
    return Fraction(32, bits) if 32 % bits else 32 // bits


class KIVICache(CompressedKVCache):
    method = "kivi"
    # The first tokens of the sequence (the attention sink) are kept exact beside the store and
    # attended in place of their compressed columns, which hold a copy of the next token so
    # that they do not widen group 0's per-channel key range. 0 turns it off (the cache as it
    # was before: same numbers, results/kivi_quality_nosink_split.json). A class attribute, not
    # a config field: only 1 and 0 were measured, and a field would change every schema.
    exact_sink_tokens = 1

    def _setup(self) -> None:
        config = self.config
        bits = config.bits_for_layer(self.layer_index, self.n_layers)
        self.key_bits = config.key_bits if config.key_bits is not None else bits
        self.value_bits = config.value_bits if config.value_bits is not None else bits
        self.group_size = config.kivi_group_size
        self._residual_length = config.kivi_residual_length
        if not hasattr(self, "sink_keys"):
            # The exact sink, (B, H, S, D) / (B, H, S, Dv) in the input dtype; None until the
            # first group is encoded (and for states written before the sink was kept).
            self.sink_keys = self.sink_values = None
        # NB: never name an attribute `bits`: mlx-lm's scaled_dot_product_attention treats any
        # cache with `bits` as its own QuantizedKVCache.

    @property
    def block_size(self) -> int:
        return self.group_size

    @property
    def residual_length(self) -> int:
        return self._residual_length

    def _side_dtype(self) -> mx.Dtype:
        return mx.bfloat16 if self.dtype == mx.bfloat16 else mx.float16

    def _check_shape(self, head_dim: int, value_dim: int) -> None:
        if value_dim % self.group_size:
            raise QuantizerConfigError(
                f"KIVICache (layer {self.layer_index}): value head_dim={value_dim} is not a "
                f"multiple of kivi_group_size={self.group_size}: allowed is a kivi_group_size "
                f"dividing the head_dim (e.g. 32)"
            )
        if head_dim < 1:
            raise QuantizerConfigError(f"KIVICache (layer {self.layer_index}): head_dim={head_dim} must be >= 1")

    def _store_layout(self) -> list[StoreArray]:
        D, Dv, G = self.head_dim, self.value_dim, self.group_size
        side = self._side_dtype()
        key_tokens_per_word = _tokens_per_word(self.key_bits)
        return [
            # K^T: (B, H, D, tokens) -> codes (B, H, D, tokens * bits / 32), side (B, H, D, tokens / G)
            StoreArray("key_codes", axis=3, tokens_per_index=key_tokens_per_word, dtype=mx.uint32, trailing=(D, -1)),
            StoreArray("key_scales", axis=3, tokens_per_index=G, dtype=side, trailing=(D, -1)),
            StoreArray("key_biases", axis=3, tokens_per_index=G, dtype=side, trailing=(D, -1)),
            # V: (B, H, tokens, Dv) -> codes (B, H, tokens, Dv * bits / 32), side (B, H, tokens, Dv / G)
            StoreArray("value_codes", axis=2, tokens_per_index=1, dtype=mx.uint32, trailing=(-1, Dv * self.value_bits // 32)),
            StoreArray("value_scales", axis=2, tokens_per_index=1, dtype=side, trailing=(-1, Dv // G)),
            StoreArray("value_biases", axis=2, tokens_per_index=1, dtype=side, trailing=(-1, Dv // G)),
        ]

    def _encode(self, keys: mx.array, values: mx.array) -> dict[str, mx.array]:
        if self.n_compressed == 0:
            # This block starts the sequence: set its sink aside, exact.
            keys, values = self._set_sink_aside(keys, values)
        # On CUDA one kernel encodes K^T and V straight into the store layout, bit for bit the
        # compiled path's (cache/fused_encode_affine.py); elsewhere the compiled affine_quantize.
        fused = fused_encode_affine.encode_step(self, keys, values)
        if fused is not None:
            return fused
        G, side = self.group_size, self._side_dtype()
        key_codes, key_scales, key_biases = compiled_affine_quantize(G, self.key_bits, side)(keys.swapaxes(-1, -2))
        value_codes, value_scales, value_biases = compiled_affine_quantize(G, self.value_bits, side)(values)
        return {
            "key_codes": key_codes,
            "key_scales": key_scales,
            "key_biases": key_biases,
            "value_codes": value_codes,
            "value_scales": value_scales,
            "value_biases": value_biases,
        }

    def _decode(self) -> tuple[mx.array, mx.array]:
        n, G, s, dtype = self.n_compressed, self.group_size, self.store, self.dtype
        key_words = int(n // _tokens_per_word(self.key_bits))
        # Side data cast up first: dequantize computes in the scales' dtype.
        keys_t = mx.dequantize(
            s["key_codes"][..., :key_words],
            s["key_scales"][..., : n // G].astype(dtype),
            s["key_biases"][..., : n // G].astype(dtype),
            group_size=G,
            bits=self.key_bits,
        )
        values = mx.dequantize(
            s["value_codes"][:, :, :n],
            s["value_scales"][:, :, :n].astype(dtype),
            s["value_biases"][:, :, :n].astype(dtype),
            group_size=G,
            bits=self.value_bits,
        )
        keys = keys_t.swapaxes(-1, -2)
        if self.sink_keys is None:
            return keys, values
        S = self._sink_length()
        return (
            mx.concatenate([self.sink_keys.astype(dtype), keys[:, :, S:]], axis=2),
            mx.concatenate([self.sink_values.astype(dtype), values[:, :, S:]], axis=2),
        )

    # ---- the exact sink -----------------------------------------------------------------------
    def _sink_length(self) -> int:
        return 0 if self.sink_keys is None else self.sink_keys.shape[2]

    def _set_sink_aside(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Keep the block's first exact_sink_tokens tokens exact (a copy, not a view of the
        chunk) and return the block with each of them replaced by the first token after the
        sink, for quantization only: the copy adds nothing to any group's range, so group 0
        quantizes like any other group. The compressed columns [0, S) are never read."""
        S = min(self.exact_sink_tokens, keys.shape[2] - 1)
        if S <= 0:
            self.sink_keys = self.sink_values = None
            return keys, values
        self.sink_keys = mx.contiguous(keys[:, :, :S])
        self.sink_values = mx.contiguous(values[:, :, :S])
        return with_sink_placeholder(keys, S), with_sink_placeholder(values, S)

    def _scores(self, q: mx.array) -> mx.array:
        s = self.store
        # float32 on the CPU: with bf16 queries and side data MLX's CPU kernel runs ~12x slower
        # (8B attention shape, 8192 tokens: 221 ms against 18 ms; session 39).
        scores = mx.quantized_matmul(
            q.astype(compute_dtype(q.dtype)), s["key_codes"], s["key_scales"], s["key_biases"],
            transpose=False, group_size=self.group_size, bits=self.key_bits,
        )
        if self.sink_keys is None:
            return scores
        # Columns [0, S) are the sink's: its exact scores replace those of the placeholder codes.
        S = self._sink_length()
        sink = (q @ self.sink_keys.astype(q.dtype).swapaxes(-1, -2)).astype(scores.dtype)
        return mx.concatenate([sink, scores[..., S:]], axis=-1)

    def _weighted_values(self, p: mx.array) -> mx.array:
        s = self.store
        S = self._sink_length()
        if S:
            # The sink's probabilities weigh its exact values, not the placeholder codes.
            sink_p, p = p[..., :S], mx.concatenate([mx.zeros_like(p[..., :S]), p[..., S:]], axis=-1)
        out = quantized_weighted_sum(
            p, s["value_codes"], s["value_scales"], s["value_biases"],
            group_size=self.group_size, bits=self.value_bits,
        )
        if not S:
            return out
        return out + (sink_p @ self.sink_values.astype(sink_p.dtype)).astype(out.dtype)

    def _fused_decode(self, queries: mx.array, scale: float):
        s = self.store
        # The kernels skip the sink's placeholder columns and attend its exact K/V like the window.
        sink = None if self.sink_keys is None else (self.sink_keys, self.sink_values)
        return fused_decode.decode_step(
            self, queries, scale,
            lambda: (s["key_codes"], s["key_scales"], s["key_biases"],
                     s["value_codes"], s["value_scales"], s["value_biases"]),
            group_size=self.group_size, key_bits=self.key_bits, value_bits=self.value_bits,
            skip=self._sink_length(), exact_prefix=sink,
        )

    def _prefill_keys_values(self, queries: mx.array) -> tuple[mx.array, mx.array]:
        # On CUDA one kernel writes the whole K/V (sink, decoded history, window) in the queries'
        # dtype (cache/fused_prefill_affine.py); elsewhere the base's decode + concatenations.
        s = self.store
        sink = None if self.sink_keys is None else (self.sink_keys, self.sink_values)
        fused = fused_prefill_affine.prefill_step(
            self, queries,
            lambda: (s["key_codes"], s["key_scales"], s["key_biases"],
                     s["value_codes"], s["value_scales"], s["value_biases"]),
            group_size=self.group_size, key_bits=self.key_bits, value_bits=self.value_bits,
            arith_dtype=self.dtype, sink=sink,  # _decode casts the side data to the model dtype
        )
        return super()._prefill_keys_values(queries) if fused is None else fused

    def bits_per_element(self) -> float:
        """Stored bits per cached K/V element of the compressed history: codes plus a 16-bit
        scale and a 16-bit bias per group, averaged over keys and values. The exact window and
        the exact sink (exact_sink_tokens tokens in the input dtype, which nbytes counts) are
        not included; the sink's placeholder codes are (they fill whole groups)."""
        side = 2 * 16 / self.group_size
        return (self.key_bits + self.value_bits) / 2 + side

    @property
    def nbytes(self) -> int:
        sink = 0 if self.sink_keys is None else self.sink_keys.nbytes + self.sink_values.nbytes
        return super().nbytes + sink

    def trim(self, n: int) -> int:
        # Trimming into the first group decodes it (the exact sink included) back into the exact
        # window; the sink is then set aside again when that group is encoded anew.
        trimmed = super().trim(n)
        if self.n_compressed == 0:
            self.sink_keys = self.sink_values = None
        return trimmed

    @property
    def state(self):
        return (*CompressedKVCache.state.fget(self), self.sink_keys, self.sink_values)

    @state.setter
    def state(self, v):
        # (meta, window_keys, window_values, *arrays, sink_keys, sink_values); states written
        # before the sink was kept end at the arrays: they load without a sink, and attend
        # exactly as they did (their column 0 holds token 0's own codes).
        base, sink = self._split_state(
            v, (0, 2), "(meta, window_keys, window_values, *arrays, sink_keys, sink_values), or "
            "without the two sink entries (states written before the exact sink)")
        CompressedKVCache.state.fset(self, base)
        sink = sink or (None, None)
        if (sink[0] is None) != (sink[1] is None):
            raise QuantizerConfigError("KIVICache state: sink_keys and sink_values must both be arrays or both None")
        if sink[0] is not None:
            S = sink[0].shape[2] if sink[0].ndim == 4 else -1
            expected_k = (self.batch_size, self.n_kv_heads, S, self.head_dim)
            expected_v = (self.batch_size, self.n_kv_heads, S, self.value_dim)
            if S < 1 or S > self.n_compressed or sink[0].shape != expected_k or sink[1].shape != expected_v:
                raise QuantizerConfigError(
                    f"KIVICache state: sink shapes {sink[0].shape} / {sink[1].shape} do not fit "
                    f"the cache: allowed is (batch, kv_heads, S, head_dim) = {expected_k} / "
                    f"value dim {self.value_dim}, with 1 <= S <= n_compressed={self.n_compressed}"
                )
        self.sink_keys, self.sink_values = sink
