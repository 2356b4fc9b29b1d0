"""XQuant: ultra-low-bit KV cache quantization with cross-layer sharing of the codes.

Paper: Haoqi Yang, Yao Yao, Zuchao Li, Baoyuan Qi, Guoming Liu, Hai Zhao, "XQuant: Achieving
Ultra-Low Bit KV Cache Quantization with Cross-Layer Compression", EMNLP 2025, arXiv 2510.11236.

What it stores (KIVI's layout, which XQuant builds on):
  * keys per channel: groups of `xquant_group_size` tokens share a scale and zero per channel;
  * values per token: groups of `xquant_group_size` channels share a scale and zero per token;
  * the `xquant_residual_length` most recent tokens exact (the base's window);
  * data-free calibration: the min/max levels z, z + s(2^B - 1) move inwards,
    z' = z + eta * s * (2^B - 1), s' = (1 - 2 eta) * s; codes are the plain round((x - z) / s),
    so storage stays integer codes plus one scale and zero per group (`xquant_eta`);
  * cross-layer compression: layers are paired (2k, 2k+1). The lower layer (leader) stores codes,
    scales and zeros; the upper layer (follower) stores only its own scales and zeros (the paper: from its own
    min/max; here: fitted to the leader's codes, see deviations) and dequantizes with the
    leader's codes (read through the coordinator). Pairs start at `xquant_share_from`.

Bits per element: leader B + 32/G, follower 32/G (fp16 scale and zero per group of G); a pair
averages B/2 + 32/G, e.g. 2.0 for B=2, G=32 and 1.25 for B=2, G=128.

Order within a forward pass: layer 2k calls update_and_fetch and attention before layer 2k+1,
and both encode the same token positions, so the follower's codes exist when it needs them. The
follower never encodes a block its leader has not encoded yet (those tokens stay in its exact
window), so any order is safe, just less compressed.

Measured on SmolLM2-135M (512 tokens of Pride and Prejudice, layer pairs (2k, 2k+1)): the
adjacent layers' K/V are not alike, so the paper's follower (own min/max over the leader's codes)
reconstructs keys with 75% and values with 154% relative error (2 bits; its own 2-bit codes:
18% and 39%); the least-squares fit below brings that to 47% and 97%. `xquant_share_from`
limits sharing to the deeper layers (1.0 shares nothing). See results/crosslayer_quality.json.

Deviations from the paper:
  * a follower's scale and zero are the least-squares fit of its own block to its leader's
    codes (the paper takes the follower's own min/max); still data-free, and never worse in
    squared error than the paper's choice;
  * `xquant_share_from` (default 0: every pair shares, as the paper) picks where sharing starts;
  * one eta for keys and values (the paper tunes them separately); by default 0.05 at 2 bits
    and 0 at 3 and 4 bits (see DEFAULT_ETA);
  * every adjacent pair shares codes, from layer 0 on (the paper's tables also vary which
    layers share); an odd last layer is a leader alone;
  * pairs must have the same bit width (a per-layer list must agree within each pair);
  * after `from_state` a follower holds a copy of its leader's codes (each layer's state is
    loadable on its own); `CrossLayerCoordinator.relink(caches)` drops the copy again;
  * attention uses mx.quantized_matmul on the codes (MLX's affine layout; the values, on the
    CPU, read as planes for BLAS products: cache/unpacked_products.py), never fp16 history
    (a prefill chunk's attention reads it decoded, by fused_prefill_affine's kernel on CUDA);
  * on CUDA a block's encode is one kernel per layer (cache/fused_encode_xquant.py: the leader's
    codes and side data, the follower's fit), the compiled encoders' numbers.
"""

from __future__ import annotations

import math

import mlx.core as mx

from veloxquant_mlx.cache import fused_decode, fused_encode_xquant, fused_prefill_affine
from veloxquant_mlx.cache.base import CompressedKVCache, StoreArray
from veloxquant_mlx.cache.cross_layer import CrossLayerMixin
from veloxquant_mlx.cache.split_reduction import quantized_weighted_sum
from veloxquant_mlx.errors import QuantizerConfigError

SCALE_DTYPE = mx.float16
# Calibration eta by bits when the config leaves it None: the mean squared error of min/max
# quantization of N(0, 1) groups of 32 is lowest near eta=0.05 at 2 bits (0.132 vs 0.154 at 0);
# at 3 and 4 bits any eta > 0.02 makes it worse (measured with minmax_params below).
DEFAULT_ETA = {2: 0.05, 3: 0.0, 4: 0.0}


def pack_bitstream(codes: mx.array, bits: int) -> mx.array:
    """Integer codes (..., n) -> uint32 (..., n * bits / 32) as one little-endian bit stream,
    which is MLX's packing for mx.quantize / mx.quantized_matmul at 2, 3, 4 and 8 bits."""
    n = codes.shape[-1]
    if (n * bits) % 32:
        raise QuantizerConfigError(f"pack_bitstream: {n} codes of {bits} bits do not fill whole uint32 words")
    bit_planes = (codes.astype(mx.uint32)[..., None] >> mx.arange(bits, dtype=mx.uint32)) & 1
    bit_planes = bit_planes.reshape(*codes.shape[:-1], n * bits // 32, 32)
    # The bits are disjoint, so the sum is a bitwise or.
    return mx.sum(bit_planes << mx.arange(32, dtype=mx.uint32), axis=-1).astype(mx.uint32)


def minmax_params(groups: mx.array, bits: int, eta: float):
    """Scale and zero of each group (last axis): min/max, then XQuant's calibration.

    Returns (s, z, s_cal, z_cal): codes use (s, z); dequantization uses the calibrated pair."""
    groups = groups.astype(mx.float32)
    low = mx.min(groups, axis=-1, keepdims=True)
    high = mx.max(groups, axis=-1, keepdims=True)
    levels = (1 << bits) - 1
    scale = mx.maximum((high - low) / levels, 1e-8)
    return scale, low, (1 - 2 * eta) * scale, low + eta * scale * levels


def quantize_groups(groups: mx.array, bits: int, eta: float):
    """groups (..., G) -> packed codes (..., G * bits / 32), calibrated scale and zero (...)."""
    scale, zero, scale_cal, zero_cal = minmax_params(groups, bits, eta)
    codes = mx.clip(mx.round((groups.astype(mx.float32) - zero) / scale), 0, (1 << bits) - 1)
    return (
        pack_bitstream(codes.astype(mx.uint32), bits),
        scale_cal[..., 0].astype(SCALE_DTYPE),
        zero_cal[..., 0].astype(SCALE_DTYPE),
    )


def fit_to_codes(groups: mx.array, codes: mx.array):
    """Scale and zero per group (last axis) that best map given codes onto `groups`
    (least squares): a follower's side data for its leader's codes."""
    x = groups.astype(mx.float32)
    q_mean = mx.mean(codes, axis=-1, keepdims=True)
    x_mean = mx.mean(x, axis=-1, keepdims=True)
    q_centered = codes - q_mean
    var = mx.mean(q_centered * q_centered, axis=-1, keepdims=True)
    cov = mx.mean(q_centered * (x - x_mean), axis=-1, keepdims=True)
    scale = mx.where(var > 0, cov / mx.maximum(var, 1e-12), 0.0)
    zero = x_mean - scale * q_mean
    return scale[..., 0].astype(SCALE_DTYPE), zero[..., 0].astype(SCALE_DTYPE)


# The encoders through mx.compile: their elementwise chains (min/max, rounding, bit packing, the
# least-squares fit) fuse into a few kernels, which on MLX's CUDA backend cuts the per-chunk
# encode of a prefill (see kivi.compiled_affine_quantize); bits and eta are compile-time
# constants (one trace per setting and shape), the results bit-identical (tests check it).
quantize_groups_fused = mx.compile(quantize_groups)
fit_to_codes_fused = mx.compile(fit_to_codes)


class XQuantCache(CrossLayerMixin, CompressedKVCache):
    method = "xquant"

    def __init__(self, config, layer_index: int = 0, n_layers: int = 1, coordinator=None):
        super().__init__(config, layer_index, n_layers)
        self._attach(coordinator)

    def _setup(self) -> None:
        # Not `self.bits`: mlx-lm's attention treats any cache with a `bits` attribute as its
        # own QuantizedKVCache.
        cfg = self.config
        self.code_bits = cfg.bits_for_layer(self.layer_index, self.n_layers)
        self.group = cfg.xquant_group_size
        self.eta = DEFAULT_ETA[self.code_bits] if cfg.xquant_eta is None else cfg.xquant_eta
        self._residual = cfg.xquant_residual_length
        first_shared = math.ceil(cfg.xquant_share_from * self.n_layers)
        # Pairs (2k, 2k+1) with 2k >= first_shared share codes; the rest keep their own.
        self.may_share = self.layer_index % 2 == 1 and self.layer_index - 1 >= first_shared
        if self.may_share:
            below = cfg.bits_for_layer(self.layer_index - 1, self.n_layers)
            if below != self.code_bits:
                raise QuantizerConfigError(
                    f"XQuantCache: bit_width_inlier is {below} for layer {self.layer_index - 1} "
                    f"and {self.code_bits} for layer {self.layer_index}; layers 2k and 2k+1 share "
                    "codes, so allowed is the same bit width within each pair"
                )
        # Whether this layer reads its leader's codes: decided at its first encode, kept after.
        if not hasattr(self, "shared"):
            self.shared = False

    @property
    def block_size(self) -> int:
        return self.group

    @property
    def residual_length(self) -> int:
        return self._residual

    def bits_per_element(self) -> float:
        side = 2 * 16 / self.group
        return side if self.shared else self.code_bits + side

    def _check_shape(self, head_dim: int, value_dim: int) -> None:
        if value_dim % self.group:
            raise QuantizerConfigError(
                f"XQuantCache (layer {self.layer_index}): value head_dim={value_dim} is not a "
                f"multiple of xquant_group_size={self.group}: allowed is a multiple (values are "
                "grouped along head_dim)"
            )

    # ---- cross-layer ------------------------------------------------------------------------
    def _leader(self):
        """The lower layer of this layer's pair, if its codes can serve this layer."""
        if not self.may_share:
            return None
        leader = self._peer(self.layer_index - 1)
        if leader is None or leader.shared or leader.dtype is None:
            return None
        same = (leader.batch_size, leader.n_kv_heads, leader.head_dim, leader.value_dim) == (
            self.batch_size, self.n_kv_heads, self.head_dim, self.value_dim
        )
        if not same or (leader.code_bits, leader.group) != (self.code_bits, self.group):
            return None
        return leader

    def _flush(self) -> None:
        if self.n_compressed == 0 and self.capacity == 0 and self.window_keys is not None:
            self.shared = self._leader() is not None
        if not self.shared or self.window_keys is None:
            return super()._flush()
        # A follower encodes only positions its leader has codes for; the rest stays exact:
        # the whole blocks beyond the residual that the base would flush, at most the blocks
        # its leader is ahead by. Written as that count (not by cutting the window at
        # ready + residual, flushing the head and concatenating the tail back, as before):
        # the same tokens flushed and the same window left, without the 4 slices and 2
        # concatenations that cost every decode step (2 launches on CUDA per call, and the
        # base flushes twice a step; bench/step_census.py).
        leader = self._leader()
        ready = 0 if leader is None else max(0, leader.n_compressed - self.n_compressed)
        whole = ((self.window_keys.shape[2] - self.residual_length) // self.block_size) * self.block_size
        n = min(whole, (ready // self.block_size) * self.block_size)
        if n > 0:
            self._append_compressed(
                self._encode(self.window_keys[:, :, :n], self.window_values[:, :, :n]), n
            )

    def _codes(self) -> tuple[mx.array, mx.array]:
        """Packed key codes (B, H, D, capacity * bits / 32) and value codes (B, H, capacity, .)."""
        if self.shared:
            leader = self._leader()
            if leader is None:
                raise QuantizerConfigError(
                    f"XQuantCache layer {self.layer_index} reads the codes of layer "
                    f"{self.layer_index - 1}, which is gone or changed shape"
                )
            k = leader.store["k_codes"][:, :, :, : self.capacity // self.group]
            v = leader.store["v_codes"][:, :, : self.capacity]
        else:
            k, v = self.store["k_codes"], self.store["v_codes"]
        B, H, D = k.shape[:3]
        return k.reshape(B, H, D, -1), v

    def _relinked(self) -> None:
        if not self.may_share or self.shared or "k_codes" not in self.store:
            return
        leader = self._leader()
        if leader is None or leader.n_compressed < self.n_compressed or leader.capacity < self.capacity:
            return
        n = self.n_compressed
        k_same = mx.array_equal(
            self.store["k_codes"][:, :, :, : n // self.group],
            leader.store["k_codes"][:, :, :, : n // self.group],
        )
        v_same = mx.array_equal(self.store["v_codes"][:, :, :n], leader.store["v_codes"][:, :, :n])
        if k_same.item() and v_same.item():
            del self.store["k_codes"], self.store["v_codes"]
            self._store_written()
            self.shared = True

    # ---- storage ----------------------------------------------------------------------------
    def _store_layout(self) -> list[StoreArray]:
        G, b = self.group, self.code_bits
        D, Dv = self.head_dim, self.value_dim
        layout = [
            StoreArray("k_scale", axis=3, tokens_per_index=G, dtype=SCALE_DTYPE, trailing=(D, -1)),
            StoreArray("k_zero", axis=3, tokens_per_index=G, dtype=SCALE_DTYPE, trailing=(D, -1)),
            StoreArray("v_scale", axis=2, tokens_per_index=1, dtype=SCALE_DTYPE, trailing=(-1, Dv // G)),
            StoreArray("v_zero", axis=2, tokens_per_index=1, dtype=SCALE_DTYPE, trailing=(-1, Dv // G)),
        ]
        if not self.shared:
            layout += [
                StoreArray("k_codes", axis=3, tokens_per_index=G, dtype=mx.uint32, trailing=(D, -1, G * b // 32)),
                StoreArray("v_codes", axis=2, tokens_per_index=1, dtype=mx.uint32, trailing=(-1, Dv * b // 32)),
            ]
        return layout

    def _encode(self, keys: mx.array, values: mx.array) -> dict[str, mx.array]:
        # On CUDA one kernel encodes the block (cache/fused_encode_xquant.py: the leader's codes
        # and calibrated side data, or the follower's fit to its leader's codes), bit for bit the
        # compiled path's under the CPU emulation; elsewhere the compiled encoders below.
        leader_codes = None
        if self.shared:
            leader = self._leader()
            leader_codes = (leader.store["k_codes"], leader.store["v_codes"])
        fused = fused_encode_xquant.encode_step(self, keys, values, leader_codes)
        if fused is not None:
            return fused
        B, H, n, D = keys.shape
        G, Dv = self.group, self.value_dim
        # Keys per channel: (B, H, D, n / G, G), groups along tokens.
        k_groups = keys.swapaxes(2, 3).reshape(B, H, D, n // G, G)
        # Values per token: (B, H, n, Dv / G, G), groups along channels.
        v_groups = values.reshape(B, H, n, Dv // G, G)
        if self.shared:
            k_codes, v_codes = self._leader_codes(self.n_compressed, n)
            k_scale, k_zero = fit_to_codes_fused(k_groups, k_codes)
            v_scale, v_zero = fit_to_codes_fused(v_groups, v_codes)
            return {"k_scale": k_scale, "k_zero": k_zero, "v_scale": v_scale, "v_zero": v_zero}
        k_codes, k_scale, k_zero = quantize_groups_fused(k_groups, self.code_bits, self.eta)
        v_codes, v_scale, v_zero = quantize_groups_fused(v_groups, self.code_bits, self.eta)
        return {
            "k_scale": k_scale, "k_zero": k_zero, "v_scale": v_scale, "v_zero": v_zero,
            "k_codes": k_codes, "v_codes": v_codes.reshape(B, H, n, -1),
        }

    def _leader_codes(self, start: int, n: int) -> tuple[mx.array, mx.array]:
        """The leader's integer codes of positions [start, start + n), grouped like _encode's
        groups: keys (B, H, D, n / G, G), values (B, H, n, Dv / G, G)."""
        leader, G, b = self._leader(), self.group, self.code_bits
        k = leader.store["k_codes"][:, :, :, start // G : (start + n) // G]
        B, H, D, blocks, _ = k.shape
        k = k.reshape(B, H, D, -1)
        k = mx.dequantize(k, mx.ones((B, H, D, blocks)), mx.zeros((B, H, D, blocks)), group_size=G, bits=b)
        v = leader.store["v_codes"][:, :, start : start + n]
        ones = mx.ones((B, H, n, self.value_dim // G))
        v = mx.dequantize(v, ones, mx.zeros_like(ones), group_size=G, bits=b)
        return k.reshape(B, H, D, blocks, G), v.reshape(B, H, n, self.value_dim // G, G)

    def _decode(self) -> tuple[mx.array, mx.array]:
        k_codes, v_codes = self._codes()
        G, b, n = self.group, self.code_bits, self.n_compressed
        keys = mx.dequantize(k_codes, self.store["k_scale"], self.store["k_zero"], group_size=G, bits=b)
        values = mx.dequantize(v_codes, self.store["v_scale"], self.store["v_zero"], group_size=G, bits=b)
        return (
            keys.swapaxes(2, 3)[:, :, :n].astype(self.dtype),
            values[:, :, :n].astype(self.dtype),
        )

    def _scores(self, q: mx.array) -> mx.array:
        k_codes, _ = self._codes()
        return mx.quantized_matmul(
            q, k_codes, self.store["k_scale"], self.store["k_zero"],
            transpose=False, group_size=self.group, bits=self.code_bits,
        )

    def _weighted_values(self, p: mx.array) -> mx.array:
        _, v_codes = self._codes()
        return quantized_weighted_sum(
            p, v_codes, self.store["v_scale"], self.store["v_zero"],
            group_size=self.group, bits=self.code_bits,
        )

    def _fused_decode(self, queries: mx.array, scale: float):
        def arrays():
            k_codes, v_codes = self._codes()
            s = self.store
            return k_codes, s["k_scale"], s["k_zero"], v_codes, s["v_scale"], s["v_zero"]

        # A follower's codes are its leader's: its launch plan holds while the leader's store
        # is unchanged too.
        leader = self._leader() if self.shared else None
        return fused_decode.decode_step(
            self, queries, scale, arrays,
            group_size=self.group, key_bits=self.code_bits, value_bits=self.code_bits,
            plan_key=(self.shared,) if leader is None else (self.shared, id(leader), leader.store_writes),
        )

    def _prefill_keys_values(self, queries: mx.array) -> tuple[mx.array, mx.array]:
        # On CUDA one kernel writes the whole K/V (decoded history, window) in the queries' dtype
        # (cache/fused_prefill_affine.py); elsewhere the base's decode + concatenation.
        def arrays():
            k_codes, v_codes = self._unsliced_codes()
            s = self.store
            return k_codes, s["k_scale"], s["k_zero"], v_codes, s["v_scale"], s["v_zero"]

        fused = fused_prefill_affine.prefill_step(
            self, queries, arrays, group_size=self.group, key_bits=self.code_bits,
            value_bits=self.code_bits, arith_dtype=SCALE_DTYPE,  # _decode dequantizes in float16
        )
        return super()._prefill_keys_values(queries) if fused is None else fused

    def _unsliced_codes(self) -> tuple[mx.array, mx.array]:
        """_codes() without cutting a leader's arrays to this layer's capacity: the cut key
        codes' reshape would copy them, and the prefill kernel reads only the first
        n_compressed tokens of each row, taking the row lengths from the arrays' shapes."""
        if not self.shared:
            return self._codes()
        if self._leader() is None:
            return self._codes()  # raises, naming the missing leader
        leader = self._leader()
        k = leader.store["k_codes"]
        B, H, D = k.shape[:3]
        return k.reshape(B, H, D, -1), leader.store["v_codes"]

    # ---- state: a follower's state carries its leader's codes --------------------------------
    def _state_arrays(self) -> dict[str, mx.array]:
        arrays = dict(self.store)
        if self.shared and self.capacity:
            k_codes, v_codes = self._codes()
            B, H, D = k_codes.shape[:3]
            arrays["k_codes"] = k_codes.reshape(B, H, D, self.capacity // self.group, -1)
            arrays["v_codes"] = v_codes
        return arrays

    def _set_state(self, v) -> None:
        self.shared = False  # a loaded layer holds its own codes; relink() may share them again
        CompressedKVCache.state.fset(self, v)

    state = property(CompressedKVCache.state.fget, _set_state)
