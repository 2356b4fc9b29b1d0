"""MiniCache: merge the KV caches of adjacent layers in depth, keep what does not merge.

Paper: Akide Liu, Jing Liu, Zizheng Pan, Yefei He, Gholamreza Haffari, Bohan Zhuang,
"MiniCache: KV Cache Compression in Depth Dimension for Large Language Models", NeurIPS 2024,
arXiv 2405.14366.

What it stores: from layer ceil(minicache_start_fraction * n_layers) on, layers are paired
(l, l+1). For each token and KV head of a pair, separately for keys and values:
  * one merged direction, the SLERP of the two layers' unit vectors at t = 0.5 (with
    Omega = arccos(cos(u_l, u_{l+1})): e = (sin((1-t) Omega) u_l + sin(t Omega) u_{l+1}) / sin Omega),
    held by the lower layer, in fp16 or, with `minicache_bits`, as per-token quantized codes
    (groups of 32 channels, MLX's affine layout);
  * each layer's own magnitude ||x|| (fp16): the layer restores x ~ ||x|| e;
  * retention: tokens whose two directions are too far apart (cosine below
    `minicache_threshold`) keep each layer's exact vector; per block of 32 tokens and head at
    most `minicache_retain_slots` such tokens (the least similar first), stored as exact
    vectors plus their int32 positions (-1 for an unused slot).
Layers below the start and an unpaired last layer keep their exact KV (no compression, as in the
paper's shallow layers), in a buffer grown in place and read by the fused attention, as mlx-lm's
KVCache does (cache/growing_window.py: appending to the base's window copied it whole per step).

Order within a forward pass: layer l calls update_and_fetch and attention before layer l+1, so
the lower layer cannot merge on its own: it keeps its new tokens in its exact window until the
upper layer holds the same positions. Then whichever of the two flushes first (the upper one
after its attention when the dispatcher is installed; the lower one at its next update_and_fetch
when it is not) merges the block of both layers and writes each layer's part into its cache, so
the patched and unpatched runs hold the same data at every step. The newest tokens stay exact
in both layers until the pair has merged them.

Attention reads the compressed form: scores = ||k|| (q . e_k), overwritten by the exact q . k
at retained positions; values = (p ||v||) @ e_v + p[retained] @ v_retained. On MLX's CUDA
backend a paired layer's decode step runs that as one partials kernel plus a merge
(cache/fused_decode_merged.py: the directions, magnitudes and slots read once); elsewhere, and
for shapes it does not take, the portable ops (_scores / _weighted_values) run.

A prefill chunk's attention (>= prefill_rows queries) reads a paired layer's history as plain
K/V: on CUDA one kernel writes it (cache/fused_prefill_merged.py), elsewhere the portable decode
builds it; either way its inputs wait for the chunk's queries through mx.depends, without the
base's host sync (session 6: minicache prefilled 32K at 1.41x the fp16 cache's time on the
H200, with one sync per paired layer and chunk). The pair's merge of a block runs through
mx.compile (compiled_merge_part).

State: each layer's state holds what it needs alone (the upper layer carries a copy of the
merged directions); a loaded pair keeps its history and no longer merges new tokens (they stay
exact) until `CrossLayerCoordinator.relink(caches)` re-links it.

Measured on SmolLM2-135M (512 tokens of Pride and Prejudice): the mean cosine between adjacent
layers' per-token K (and V) directions is within +-0.2 (V within +-0.03) at every depth, so the
paper's premise (high similarity from the middle of the model on) does not hold for this model:
KL 0.93, top-1 52%, PPL 33.2 (fp16 16.5) with the defaults
(results/minicache_quality_slotfix_cpu.json; KL 1.20, top-1 45% in
results/crosslayer_quality.json were measured while the growth slack's empty slots overwrote
token 0, see _slot_index). Raise `minicache_start_fraction` or use
another method for such models.

Deviations from the paper:
  * retention by an absolute cosine threshold with a fixed number of slots per 32 tokens (the
    paper uses a threshold relative to the min/max angular distance, with unbounded counts);
    fixed slots keep storage rectangular;
  * the interpolation parameter is fixed at t = 0.5;
  * merging runs on blocks of 32 tokens (whole prefill and during decoding), the last partial
    block stays exact; `minicache_residual_length` recent tokens may stay exact on top;
  * the optional quantization of the merged directions is per token (the paper pairs MiniCache
    with KIVI-style quantization).
"""

from __future__ import annotations

import math
from functools import lru_cache, partial

import mlx.core as mx

from veloxquant_mlx.cache import fused_decode_merged, fused_prefill_merged, unpacked_products
from veloxquant_mlx.cache.base import CompressedKVCache, StoreArray
from veloxquant_mlx.cache.cross_layer import CrossLayerMixin
from veloxquant_mlx.cache.growing_window import GrowingWindowMixin
from veloxquant_mlx.cache.split_reduction import quantized_scores
from veloxquant_mlx.errors import QuantizerConfigError

BLOCK = 32
QUANT_GROUP = 32
SLERP_T = 0.5
SIDE_DTYPE = mx.float16
EPS = 1e-6


def pair_roles(n_layers: int, start_fraction: float) -> list[str]:
    """'plain', 'lower' or 'upper' for each layer."""
    start = math.ceil(start_fraction * n_layers)
    roles = ["plain"] * n_layers
    for lower in range(start, n_layers - 1, 2):
        roles[lower], roles[lower + 1] = "lower", "upper"
    return roles


def slerp_merge(x_lower: mx.array, x_upper: mx.array):
    """Two layers' vectors (..., D) -> merged unit direction, magnitudes, cosine (...)."""
    x_lower = x_lower.astype(mx.float32)
    x_upper = x_upper.astype(mx.float32)
    mag_lower = mx.linalg.norm(x_lower, axis=-1)
    mag_upper = mx.linalg.norm(x_upper, axis=-1)
    u_lower = x_lower / mx.maximum(mag_lower, EPS)[..., None]
    u_upper = x_upper / mx.maximum(mag_upper, EPS)[..., None]
    cos = mx.clip(mx.sum(u_lower * u_upper, axis=-1), -1.0, 1.0)
    omega = mx.arccos(cos)[..., None]
    sin_omega = mx.sin(omega)
    # Nearly parallel directions: SLERP tends to the linear interpolation.
    parallel = sin_omega < 1e-4
    w_lower = mx.where(parallel, 1 - SLERP_T, mx.sin((1 - SLERP_T) * omega) / mx.maximum(sin_omega, 1e-4))
    w_upper = mx.where(parallel, SLERP_T, mx.sin(SLERP_T * omega) / mx.maximum(sin_omega, 1e-4))
    merged = w_lower * u_lower + w_upper * u_upper
    merged = merged / mx.maximum(mx.linalg.norm(merged, axis=-1, keepdims=True), EPS)
    return merged, mag_lower, mag_upper, cos


def merge_part(x_low: mx.array, x_up: mx.array, offset: mx.array, *, slots: int, threshold: float,
               dir_bits, dtype):
    """One part (K or V) of a block of both layers, (B, H, n, D) each, n whole blocks of 32,
    starting at position `offset` (an int32 scalar array) -> (the lower layer's arrays: merged
    direction (fp16, or codes, scales, biases), magnitude, [retained vectors, positions]; the
    upper layer's: magnitude, [retained vectors, positions]). Retention: per block of 32 tokens
    the `slots` least similar tokens (cosine below `threshold`) keep each layer's exact vector
    and their absolute position; an unused slot holds position -1 (and the block's first
    token's vector, never read)."""
    merged, mag_low, mag_up, cos = slerp_merge(x_low, x_up)
    if dir_bits is None:
        low = [merged.astype(SIDE_DTYPE)]
    else:
        codes, scales, biases = mx.quantize(merged, group_size=QUANT_GROUP, bits=dir_bits)
        low = [codes, scales.astype(SIDE_DTYPE), biases.astype(SIDE_DTYPE)]
    low.append(mag_low.astype(SIDE_DTYPE))
    up = [mag_up.astype(SIDE_DTYPE)]
    if slots:
        B, H, n = cos.shape
        blocks = cos.reshape(B, H, n // BLOCK, BLOCK)
        order = mx.argsort(blocks, axis=-1)[..., :slots]  # least similar first
        chosen_cos = mx.take_along_axis(blocks, order, axis=-1)
        local = order + mx.arange(n // BLOCK)[:, None] * BLOCK  # position within the block of n
        kept = chosen_cos < threshold
        positions = mx.where(kept, (local + offset).astype(mx.int32), -1).reshape(B, H, -1)
        index = mx.where(kept, local, 0).reshape(B, H, -1)[..., None]
        low += [mx.take_along_axis(x_low, index, axis=2).astype(dtype), positions]
        up += [mx.take_along_axis(x_up, index, axis=2).astype(dtype), positions]
    return tuple(low), tuple(up)


# False: the pair's merge runs as uncompiled ops (`--set minicache.COMPILE_MERGE=0` in the bench
# modules). Why a switch: on MLX's CUDA backend a compiled graph's fused kernels go through nvrtc,
# whose default contracts a multiply and an add into one FMA, so the compiled merge may store
# directions that differ from the uncompiled ops' by a float32 rounding there (the CPU's are bit
# for bit the same, tested). Not yet checked on a GPU; the quality is the same either way, the
# bits across backends may not be.
COMPILE_MERGE = True


@lru_cache(maxsize=None)
def compiled_merge_part(slots: int, threshold: float, dir_bits, dtype):
    """merge_part for one setting through mx.compile (the settings are compile-time constants;
    one trace per block shape): its elementwise chains (norms, SLERP weights, casts) fuse into a
    few kernels. A paired layer's prefill chunk built ~150 MLX ops for the pair's merge
    (tests/cache/bench_pair_prefill.py, the upper layer's count), each a kernel launch on a GPU;
    bit for bit the uncompiled ops on the CPU (tests/cache/test_minicache_prefill.py checks it)."""
    return mx.compile(partial(merge_part, slots=slots, threshold=threshold, dir_bits=dir_bits, dtype=dtype))


class MiniCacheCache(GrowingWindowMixin, CrossLayerMixin, CompressedKVCache):
    method = "minicache"

    def __init__(self, config, layer_index: int = 0, n_layers: int = 1, coordinator=None):
        super().__init__(config, layer_index, n_layers)
        self._attach(coordinator)

    # ---- plain layers: the whole history exact, kept like mlx-lm's KVCache -------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if self.role != "plain":
            return super().update_and_fetch(keys, values)
        # Never compressed: written in place into a growing buffer (growing_window.py), not
        # concatenated to the window (a copy of the whole history per step).
        self._validate_input(keys, values)
        self._append_in_place(keys, values)
        self.offset += keys.shape[2]
        return self.window_keys, self.window_values

    def attention(self, queries: mx.array, scale: float, mask=None, sinks=None) -> mx.array:
        if self.role == "plain" and sinks is None and not isinstance(mask, mx.array):
            return self._attend_whole_window(queries, scale, mask)
        return super().attention(queries, scale, mask, sinks)

    def _setup(self) -> None:
        cfg = self.config
        self.role = pair_roles(self.n_layers, cfg.minicache_start_fraction)[self.layer_index]
        self.threshold = cfg.minicache_threshold
        self.slots = cfg.minicache_retain_slots
        self.dir_bits = cfg.minicache_bits
        self._residual = cfg.minicache_residual_length
        # A lower layer's state carries the merged directions; an upper layer's state a copy.
        if not hasattr(self, "owns_directions"):
            self.owns_directions = self.role == "lower"

    @property
    def block_size(self) -> int:
        return BLOCK

    @property
    def residual_length(self) -> int:
        return self._residual

    def _check_shape(self, head_dim: int, value_dim: int) -> None:
        if self.dir_bits is not None and (head_dim % QUANT_GROUP or value_dim % QUANT_GROUP):
            raise QuantizerConfigError(
                f"MiniCacheCache (layer {self.layer_index}): head_dim={head_dim} / value "
                f"head_dim={value_dim} with minicache_bits={self.dir_bits}: allowed is a "
                f"multiple of {QUANT_GROUP} (directions are quantized in groups of {QUANT_GROUP})"
            )

    def bits_per_element(self) -> float:
        """Stored bits per cached element of this layer (compressed part); a pair shares the
        directions, counted in the lower layer."""
        if self.role == "plain":
            return 16.0
        D = self.head_dim or 64
        side = (16 + self.slots / BLOCK * (16 * D + 32)) / D  # magnitude, retained slots
        if not self.owns_directions:
            return side
        direction = 16.0 if self.dir_bits is None else self.dir_bits + 32 / QUANT_GROUP
        return direction + side

    # ---- pairing ----------------------------------------------------------------------------
    def _partner(self):
        index = self.layer_index + (1 if self.role == "lower" else -1)
        partner = self._peer(index) if self.role != "plain" else None
        if partner is None or partner.dtype is None or self.dtype is None:
            return None
        if (partner.batch_size, partner.n_kv_heads, partner.head_dim, partner.value_dim) != (
            self.batch_size, self.n_kv_heads, self.head_dim, self.value_dim
        ):
            raise QuantizerConfigError(
                f"MiniCacheCache: layers {min(index, self.layer_index)} and "
                f"{max(index, self.layer_index)} are merged but have different KV shapes; "
                "allowed is the same batch, kv heads and head_dim within a pair"
            )
        return partner

    def _flush(self) -> None:
        # Either layer of a linked pair merges the block both hold (the upper one after its
        # attention, the lower one at its next update when attention is not patched); plain
        # layers and pairs loaded without relink keep their tokens exact.
        if self.role == "plain" or self._window_length() < self.residual_length + BLOCK:
            # No block to merge (n below is 0 whenever this layer's own window is short): 31 of
            # a decode's 32 steps end here, before the partner's lookup and checks.
            return
        partner = self._partner()
        if partner is None:
            return
        lower, upper = (self, partner) if self.role == "lower" else (partner, self)
        if upper.owns_directions or lower.n_compressed != upper.n_compressed or partner.window_keys is None:
            return
        n_window = min(lower.window_keys.shape[2], upper.window_keys.shape[2])
        n = ((n_window - self.residual_length) // BLOCK) * BLOCK
        if n <= 0:
            return
        low_part, up_part = upper._merge(
            lower.window_keys[:, :, :n], lower.window_values[:, :, :n],
            upper.window_keys[:, :, :n], upper.window_values[:, :, :n],
        )
        lower._append_compressed(low_part, n)
        upper._append_compressed(up_part, n)

    def _merge(self, k_low, v_low, k_up, v_up):
        """A block of both layers -> (the lower layer's arrays, the upper layer's arrays)."""
        low, up = {}, {}
        if COMPILE_MERGE:
            merge = compiled_merge_part(self.slots, self.threshold, self.dir_bits, self.dtype)
        else:
            merge = partial(merge_part, slots=self.slots, threshold=self.threshold,
                            dir_bits=self.dir_bits, dtype=self.dtype)
        # The block's first position: an input, not a constant, so that one trace serves every
        # chunk of the same length.
        offset = mx.array(self.n_compressed, dtype=mx.int32)
        for part, x_low, x_up in (("k", k_low, k_up), ("v", v_low, v_up)):
            low_arrays, up_arrays = merge(x_low, x_up, offset)
            low.update({f"{name}_{part}": a for name, a in zip(self._merged_names("lower"), low_arrays)})
            up.update({f"{name}_{part}": a for name, a in zip(self._merged_names("upper"), up_arrays)})
        return low, up

    def _merged_names(self, role: str) -> list[str]:
        """The names (without _k / _v) of merge_part's arrays for the lower or upper layer."""
        names = ([] if role == "upper" else ["dir"] if self.dir_bits is None else ["dir", "dirscale", "dirbias"])
        return names + ["mag"] + (["ret", "retpos"] if self.slots else [])

    def _relinked(self) -> None:
        if self.role != "upper" or not self.owns_directions:
            return
        lower = self._peer(self.layer_index - 1)
        if lower is None or lower.n_compressed != self.n_compressed or lower.capacity != self.capacity:
            return
        names = [n for n in self._direction_names() if n in self.store]
        if all(mx.array_equal(self.store[n], lower.store[n]).item() for n in names):
            for name in names:
                del self.store[name]
            self.owns_directions = False
            self._store_written()

    # ---- storage ----------------------------------------------------------------------------
    def _direction_names(self) -> list[str]:
        names = ["dir_k", "dir_v"]
        if self.dir_bits is not None:
            names += ["dirscale_k", "dirbias_k", "dirscale_v", "dirbias_v"]
        return names

    def _store_layout(self) -> list[StoreArray]:
        if self.role == "plain":
            return []
        layout = []
        slot_tokens = BLOCK // self.slots if self.slots else 0
        for part, dim in (("k", self.head_dim), ("v", self.value_dim)):
            if self.owns_directions:
                if self.dir_bits is None:
                    layout.append(StoreArray(f"dir_{part}", 2, 1, SIDE_DTYPE, (-1, dim)))
                else:
                    layout += [
                        StoreArray(f"dir_{part}", 2, 1, mx.uint32, (-1, dim * self.dir_bits // 32)),
                        StoreArray(f"dirscale_{part}", 2, 1, SIDE_DTYPE, (-1, dim // QUANT_GROUP)),
                        StoreArray(f"dirbias_{part}", 2, 1, SIDE_DTYPE, (-1, dim // QUANT_GROUP)),
                    ]
            layout.append(StoreArray(f"mag_{part}", 2, 1, SIDE_DTYPE, (-1,)))
            if self.slots:
                layout += [
                    StoreArray(f"ret_{part}", 2, slot_tokens, self.dtype, (-1, dim)),
                    StoreArray(f"retpos_{part}", 2, slot_tokens, mx.int32, (-1,)),
                ]
        return layout

    def _direction_store(self) -> dict:
        """The store holding the pair's merged directions: this layer's, or its lower partner's."""
        if self.owns_directions:
            return self.store
        lower = self._peer(self.layer_index - 1)
        if lower is None:
            raise QuantizerConfigError(
                f"MiniCacheCache layer {self.layer_index} reads the merged directions of "
                f"layer {self.layer_index - 1}, which is gone"
            )
        return lower.store

    def _directions(self, part: str):
        """The pair's merged directions of `part` over this layer's capacity."""
        source = self._direction_store()
        cap = self.capacity
        if self.dir_bits is None:
            return (source[f"dir_{part}"][:, :, :cap],)
        return tuple(source[f"{name}_{part}"][:, :, :cap] for name in ("dir", "dirscale", "dirbias"))

    def _slot_index(self, part: str) -> mx.array:
        """Retained slots -> column index; unused slots point at a dummy column `capacity`.
        Slots of the growth slack (blocks not merged yet) are unused too: the store fills them
        with zeros, i.e. position 0, which put zero vectors over token 0 (the attention sink)
        whenever capacity > n_compressed; after a trim they may hold stale positions."""
        return self._slot_columns(self.store[f"retpos_{part}"])

    def _slot_columns(self, positions: mx.array) -> mx.array:
        """_slot_index of given retained positions (B, H, slots over capacity)."""
        merged = mx.arange(positions.shape[-1]) < self.n_compressed // BLOCK * self.slots
        return mx.where(merged & (positions >= 0), positions, self.capacity)

    def _encode(self, keys, values):  # merging is done by the pair in _flush
        raise NotImplementedError

    def _decode(self) -> tuple[mx.array, mx.array]:
        return self._decoded_history(self._history_arrays())

    def _history_arrays(self) -> dict[str, mx.array]:
        """What the decoded history is computed from, by name: the pair's directions over this
        layer's capacity (and their scales / biases), this layer's magnitudes and retained slots."""
        arrays = {}
        for part in ("k", "v"):
            names = ["dir"] if self.dir_bits is None else ["dir", "dirscale", "dirbias"]
            arrays.update({f"{name}_{part}": a for name, a in zip(names, self._directions(part))})
            names = ["mag", "ret", "retpos"] if self.slots else ["mag"]
            arrays.update({f"{name}_{part}": self.store[f"{name}_{part}"] for name in names})
        return arrays

    def _decoded_history(self, arrays: dict[str, mx.array]) -> tuple[mx.array, mx.array]:
        """The history [0, n_compressed) as K, V in the cache's dtype from _history_arrays()
        (or the same arrays made to wait for a prefill chunk's queries)."""
        out = []
        for part in ("k", "v"):
            direction = arrays[f"dir_{part}"]
            if self.dir_bits is not None:
                direction = mx.dequantize(direction, arrays[f"dirscale_{part}"], arrays[f"dirbias_{part}"],
                                          group_size=QUANT_GROUP, bits=self.dir_bits)
            x = arrays[f"mag_{part}"][..., None].astype(mx.float32) * direction.astype(mx.float32)
            if self.slots:
                x = mx.concatenate([x, mx.zeros_like(x[:, :, :1])], axis=2)
                index = self._slot_columns(arrays[f"retpos_{part}"])[..., None]
                index = mx.broadcast_to(index, (*index.shape[:-1], x.shape[-1]))
                x = mx.put_along_axis(x, index, arrays[f"ret_{part}"].astype(mx.float32), axis=2)
                x = x[:, :, :-1]
            out.append(x[:, :, : self.n_compressed].astype(self.dtype))
        return out[0], out[1]

    def _prefill_keys_values(self, queries: mx.array) -> tuple[mx.array, mx.array]:
        # On CUDA one kernel writes a paired layer's whole K/V (cache/fused_prefill_merged.py).
        # Elsewhere the base's decode + concatenation, but ordered after the queries without the
        # base's host sync: the decode's inputs wait for the queries (mx.depends, as the kernel
        # paths' do), so no op of this layer's decoded history runs, nor holds memory, before
        # the model up to this layer has (what the base's prefill_eval_queries step bounds).
        fused = fused_prefill_merged.prefill_step(self, queries)
        if fused is not None:
            return fused
        if self.role == "plain" or self.n_compressed == 0:
            return super()._prefill_keys_values(queries)
        arrays = self._history_arrays()
        arrays = dict(zip(arrays, self._inputs_after_queries(list(arrays.values()), queries)))
        keys, values = self._decoded_history(arrays)
        if self.window_keys is not None:
            keys = mx.concatenate([keys, self.window_keys], axis=2)
            values = mx.concatenate([values, self.window_values], axis=2)
        return keys.astype(queries.dtype), values.astype(queries.dtype)

    def _scores(self, q: mx.array) -> mx.array:
        direction = self._directions("k")
        if self.dir_bits is None:
            raw = q @ direction[0].astype(q.dtype).swapaxes(-1, -2)
        else:
            raw = _direction_product(q, direction, self.dir_bits, transpose=True)
        scores = raw * self.store["mag_k"][:, :, None, :].astype(raw.dtype)
        if not self.slots:
            return scores
        exact = q @ self.store["ret_k"].astype(q.dtype).swapaxes(-1, -2)  # (B, H, R, slots)
        scores = mx.concatenate([scores, mx.zeros_like(scores[..., :1])], axis=-1)
        index = mx.broadcast_to(self._slot_index("k")[:, :, None, :], exact.shape)
        return mx.put_along_axis(scores, index, exact.astype(scores.dtype), axis=-1)[..., :-1]

    def _fused_decode(self, queries: mx.array, scale: float):
        # A paired layer's decode step through fused_decode_merged's CUDA kernel where it runs
        # (None elsewhere: the portable _scores / _weighted_values path); plain layers attend
        # their whole window with mx.fast in attention() and never get here with a decode step.
        return fused_decode_merged.decode_step(self, queries, scale)

    def _weighted_values(self, p: mx.array) -> mx.array:
        out_exact = None
        if self.slots:
            index = mx.broadcast_to(
                self._slot_index("v")[:, :, None, :], (*p.shape[:-1], self.store["retpos_v"].shape[-1])
            )
            padded = mx.concatenate([p, mx.zeros_like(p[..., :1])], axis=-1)
            p_slots = mx.take_along_axis(padded, index, axis=-1)
            out_exact = p_slots @ self.store["ret_v"].astype(p.dtype)
            # Retained tokens do not also take the merged value.
            p = mx.put_along_axis(padded, index, mx.zeros_like(p_slots), axis=-1)[..., :-1]
        weights = p * self.store["mag_v"][:, :, None, :].astype(p.dtype)
        direction = self._directions("v")
        if self.dir_bits is None:
            out = weights @ direction[0].astype(p.dtype)
        else:
            out = _direction_product(weights, direction, self.dir_bits, transpose=False)
        return out if out_exact is None else out + out_exact

    # ---- state: an upper layer's state carries a copy of the merged directions ------------------
    def _state_arrays(self) -> dict[str, mx.array]:
        arrays = dict(self.store)
        if self.role == "upper" and not self.owns_directions and self.capacity:
            for part in ("k", "v"):
                names = ["dir"] if self.dir_bits is None else ["dir", "dirscale", "dirbias"]
                for name, array in zip(names, self._directions(part)):
                    arrays[f"{name}_{part}"] = array
        return arrays

    def _set_state(self, v) -> None:
        CompressedKVCache.state.fset(self, v)
        self.owns_directions = self.role != "plain"

    state = property(CompressedKVCache.state.fget, _set_state)


def _direction_product(x: mx.array, direction, bits: int, transpose: bool) -> mx.array:
    """x times the quantized directions (codes, scales, biases; per token, in groups of
    QUANT_GROUP), in x's dtype: on the CPU read as planes for BLAS products
    (cache/unpacked_products.py, 2-4x MLX's affine kernels there), elsewhere mx.quantized_matmul
    (the weighted sum in one call, not split_reduction's chunks: as before the planes)."""
    if transpose:
        return quantized_scores(x, *direction, group_size=QUANT_GROUP, bits=bits)
    if unpacked_products.serves(bits):
        return unpacked_products.affine_weighted_sum(x, *direction, group_size=QUANT_GROUP, bits=bits).astype(x.dtype)
    return mx.quantized_matmul(x, *direction, transpose=False, group_size=QUANT_GROUP, bits=bits)
