"""PyramidKV: per-layer token budgets that shrink with depth, tokens chosen by attention.

Paper: Zefan Cai, Yichi Zhang, Bofei Gao, Yuliang Liu, Tianyu Liu, Keming Lu, Wayne Xiong,
Yue Dong, Baobao Chang, Junjie Hu, Wen Xiao, "PyramidKV: Dynamic KV Cache Compression based on
Pyramidal Information Funneling", arXiv 2406.02069 (2024).

What it does:
  * budgets: layer l keeps `window + k_l` prompt tokens, k_l an arithmetic sequence from
    k_0 = 2 (budget - window) - k_top at the bottom to k_top = (budget - window) / beta at the
    top, so the mean over layers is `pyramidkv_budget` (the paper's schedule, beta = 20);
  * selection at prefill: the last `pyramidkv_window` queries of the prompt (the observation
    window) vote with their attention probabilities; the votes are average-pooled over
    neighbouring tokens (`pyramidkv_kernel`), the k_l best tokens outside the window are kept
    with the whole window, the rest are evicted;
  * decoding appends every new token (the paper compresses the prompt only).

Positions: evicted tokens leave gaps, so every kept token carries its true position (an int32
array per head). `offset` stays the true number of tokens seen, which is what RoPE and the
model's masks need; `size()` is the same number. The kept count is `n_kept` (<= offset).
Causal masks inside a multi-token chunk are built from the positions.

Trim: tokens appended after the last eviction can be trimmed; trimming into the compressed
prompt is refused with a clear error (different heads kept different prompt tokens, so there is
no single cut).

Deviations from the paper:
  * GQA: one selection per KV head, the votes of its query heads summed (the paper's code
    selects per attention head; per query head would store rep copies of each KV head);
  * chunked prefill: each multi-token chunk before the first decode step is a selection point
    with its own last queries as the window (the paper compresses one full prompt once); for a
    prompt of one chunk (mlx-lm's default prefill step is 2048 tokens) this is the paper;
  * selection needs the queries, which only the attention call sees: without the integration's
    dispatcher nothing is evicted and a warning says so (update_and_fetch alone stays correct);
  * kept tokens stay in the input dtype (no quantization of the kept set).

The coordinator holds the layers' caches; the budgets depend only on (config, n_layers), so each
layer's state carries its own budget and loads alone.
"""

from __future__ import annotations

import json
import warnings

import mlx.core as mx

from veloxquant_mlx.cache import cpu_softmax
from veloxquant_mlx.cache.base import CompressedKVCache
from veloxquant_mlx.cache.cross_layer import CrossLayerMixin
from veloxquant_mlx.errors import QuantizerConfigError


def pyramid_budgets(budget: int, window: int, beta: int, n_layers: int) -> list[int]:
    """Tokens kept per layer after prefill (window included), bottom layer first."""
    selected = budget - window
    if n_layers == 1:
        return [budget]
    low = selected / beta
    high = 2 * selected - low
    stride = (high - low) / (n_layers - 1)
    return [window + max(0, round(high - layer * stride)) for layer in range(n_layers)]


def average_pool(votes: mx.array, kernel: int) -> mx.array:
    """Mean over `kernel` neighbours along the last axis (zero padding, as torch avg_pool1d)."""
    if kernel == 1:
        return votes
    pad = kernel // 2
    padded = mx.pad(votes, [(0, 0)] * (votes.ndim - 1) + [(pad, pad)])
    sums = mx.cumsum(padded, axis=-1)
    sums = mx.pad(sums, [(0, 0)] * (votes.ndim - 1) + [(1, 0)])
    return (sums[..., kernel:] - sums[..., :-kernel]) / kernel


class PyramidKVCache(CrossLayerMixin, CompressedKVCache):
    method = "pyramidkv"

    def __init__(self, config, layer_index: int = 0, n_layers: int = 1, coordinator=None):
        super().__init__(config, layer_index, n_layers)
        self.evicted_upto = 0  # prompt positions before this were subject to selection
        self.decoding = False  # a single-token step happened: no more selection
        self.attended = False  # attention() ran at least once (the dispatcher is installed)
        # Kept tokens [0, positions_written) have their positions in the store; the rest, the
        # decode steps' tokens since, are contiguous up to offset - 1 and written when read
        # (_write_positions). Why: writing one position per step cost each layer an arange and a
        # slice update (two launches) on a host-bound step (the H200, README: session 7).
        self.positions_written = 0
        self._attach(coordinator)

    def _setup(self) -> None:
        cfg = self.config
        self.window = cfg.pyramidkv_window
        self.kernel = cfg.pyramidkv_kernel
        if cfg.pyramidkv_budget <= self.window:
            raise QuantizerConfigError(
                f"PyramidKVCache: pyramidkv_budget={cfg.pyramidkv_budget} must exceed "
                f"pyramidkv_window={self.window} (the window is always kept)"
            )
        if not 0 <= self.layer_index < self.n_layers:
            raise QuantizerConfigError(
                f"PyramidKVCache: layer_index={self.layer_index} is out of range for "
                f"n_layers={self.n_layers}"
            )
        budgets = pyramid_budgets(cfg.pyramidkv_budget, self.window, cfg.pyramidkv_beta, self.n_layers)
        self.layer_budget = budgets[self.layer_index]

    @property
    def block_size(self) -> int:
        return 1

    def bits_per_element(self) -> float:
        # Kept tokens in the input dtype plus a 32-bit position per token and head.
        dtype_bits = 16 if self.dtype is None else self.dtype.size * 8
        return dtype_bits + 32 / (self.head_dim + self.value_dim or 1)

    @property
    def n_kept(self) -> int:
        return self.n_compressed

    # ---- the mlx-lm contract ----------------------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self._validate_input(keys, values)
        L = keys.shape[2]
        if L == 1 and not self.decoding:
            self.decoding = True
            if not self.attended and self.n_kept > self.layer_budget:
                warnings.warn(
                    f"PyramidKVCache layer {self.layer_index}: no attention call saw the prompt's "
                    "queries (is the integration's attention dispatcher installed?), so nothing "
                    f"was evicted: the cache holds all {self.n_kept} tokens uncompressed",
                    stacklevel=2,
                )
        self._ensure_capacity(self.n_kept + L)
        n = self.n_kept
        self.store["keys"][:, :, n : n + L] = keys
        self.store["values"][:, :, n : n + L] = values
        self.n_compressed += L
        self.offset += L
        if not (L == 1 and self.decoding):
            self._write_positions()  # this chunk's (and any decode steps' before it)
        return self._full_keys_values()

    def _write_positions(self) -> None:
        """Write the positions of kept tokens [positions_written, n_kept): the tokens appended
        since the last write, contiguous and ending at offset - 1."""
        start, n = self.positions_written, self.n_kept
        if start >= n:
            return
        first = self.offset - (n - start)
        self.store["positions"][:, :, start:n] = mx.broadcast_to(
            mx.arange(first, self.offset, dtype=mx.int32), (self.batch_size, self.n_kv_heads, n - start)
        )
        self.positions_written = n

    def _full_keys_values(self):
        n = self.n_kept
        return self.store["keys"][:, :, :n], self.store["values"][:, :, :n]

    def attention(self, queries: mx.array, scale: float, mask=None, sinks=None) -> mx.array:
        if sinks is not None:
            raise QuantizerConfigError(
                f"PyramidKVCache (layer {self.layer_index}) does not support attention sinks"
            )
        self.attended = True
        B, n_q_heads, L, D = queries.shape
        rep = self._gqa_repeats(n_q_heads)
        n = self.n_kept
        if isinstance(mask, mx.array):
            out = self._attend_tiled(queries, scale, mask, rep)
        else:
            # The kept tokens are in position order and this chunk's are the last L of them, so
            # the bottom-right aligned causal mask of the fused attention is the true one (the
            # gaps of evicted tokens lie wholly before the chunk). One kernel instead of explicit
            # scores: on the H200 the explicit form made decode 0.59x fp16.
            out = self._attend_fused(queries, scale)
        if L > 1 and not self.decoding and n > self.layer_budget:
            # The observation window: the chunk's last queries vote with their probabilities.
            observed = min(self.window, L)
            window_mask = mask
            if isinstance(mask, mx.array) and mask.ndim >= 2 and mask.shape[-2] == L:
                window_mask = mask[..., L - observed :, :]
            _, probs = self._attend_rows(queries[:, :, L - observed :], scale, window_mask, rep, observed)
            self._evict(probs.reshape(B, self.n_kv_heads, rep, observed, n))
        return out

    def _attend_fused(self, queries: mx.array, scale: float) -> mx.array:
        """mx.fast attention of the last L kept positions over the kept tokens, causal. On the
        CPU, where MLX's fast attention has no fused kernel and builds the chunk's whole score
        matrix, the query rows are tiled like _attend_tiled (a tile of rows [a, b) sees the
        kept tokens up to row b's position, bottom-right causal within): +100 MB of prefill
        peak at 4096 tokens without it (results/pyramidkv_memory_4096_*0487470.json)."""
        B, n_q_heads, L, _ = queries.shape
        n = self.n_kept
        keys, values = self._full_keys_values()
        keys, values = keys.astype(queries.dtype), values.astype(queries.dtype)
        rows = L
        if mx.default_device() == mx.cpu:
            rows = max(1, self.attention_tile_bytes // max(B * n_q_heads * n * 4, 1))
        tiles = []
        for start in range(0, L, rows):
            stop = min(L, start + rows)
            cut = n - L + stop
            tile = mx.fast.scaled_dot_product_attention(
                queries[:, :, start:stop], keys[:, :, :cut], values[:, :, :cut], scale=scale,
                mask="causal" if stop - start > 1 else None,
            )
            if stop < L:
                mx.eval(tile)  # free this tile's scores before the next one is built
            tiles.append(tile)
        return tiles[0] if len(tiles) == 1 else mx.concatenate(tiles, axis=2)

    def _attend_tiled(self, queries: mx.array, scale: float, mask: mx.array, rep: int) -> mx.array:
        """Attention under a given boolean mask; a long chunk is split over query rows so the
        explicit score matrix stays bounded."""
        B, n_q_heads, L, _ = queries.shape
        rows = max(1, self.attention_tile_bytes // max(B * n_q_heads * self.n_kept * 4, 1))
        tiles = []
        for start in range(0, L, rows):
            stop = min(L, start + rows)
            tile_mask = mask[..., start:stop, :] if mask.ndim >= 2 and mask.shape[-2] == L else mask
            out, _ = self._attend_rows(queries[:, :, start:stop], scale, tile_mask, rep, L - start)
            if stop < L:
                mx.eval(out)
            tiles.append(out)
        return tiles[0] if len(tiles) == 1 else mx.concatenate(tiles, axis=2)

    def _attend_rows(self, queries: mx.array, scale: float, mask, rep: int, back: int):
        """Attention of query rows at positions [offset - back, offset - back + rows)."""
        B, n_q_heads, L, D = queries.shape
        q = (queries * scale).reshape(B, self.n_kv_heads, rep * L, D)
        keys, values = self._full_keys_values()
        scores = (q @ keys.astype(q.dtype).swapaxes(-1, -2)).astype(mx.float32)
        keep = self._keep_mask_positions(L, rep, mask, self.offset - back)
        if keep is not None:
            scores = mx.where(keep, scores, mx.finfo(mx.float32).min)
        probs = cpu_softmax.softmax(scores)  # mx.softmax off the CPU and for small score matrices
        out = probs.astype(q.dtype) @ values.astype(q.dtype)
        return out.reshape(B, n_q_heads, L, -1).astype(queries.dtype), probs

    def _keep_mask_positions(self, L: int, rep: int, mask, first: int):
        """Boolean (.., rep*L, n_kept) for query positions [first, first + L), or None."""
        n = self.n_kept
        if isinstance(mask, mx.array):
            if mask.dtype != mx.bool_ or mask.shape[-1] != n:
                raise QuantizerConfigError(
                    f"PyramidKVCache (layer {self.layer_index}): an array mask must be boolean "
                    f"with {n} columns (one per kept token, from make_mask), got {mask.dtype} "
                    f"{mask.shape}"
                )
            given = mx.broadcast_to(mask, (*mask.shape[:-2], L, n))
            if given.ndim == 4:
                b, h = given.shape[:2]
                return mx.tile(given, (1, 1, rep, 1)) if h == 1 else given.reshape(b, h // rep, rep * L, n)
            return mx.tile(given, (rep, 1))
        if L == 1 and first == self.offset - 1:
            return None
        query_pos = mx.arange(first, first + L, dtype=mx.int32)
        self._write_positions()
        key_pos = self.store["positions"][:, :, :n]
        keep = key_pos[:, :, None, :] <= query_pos[None, None, :, None]
        return mx.tile(keep, (1, 1, rep, 1))

    def _evict(self, probs: mx.array) -> None:
        """Keep the window and the layer's best k prompt tokens by the window's votes
        (probs: (B, H_kv, rep, observed queries, n_kept))."""
        self._write_positions()
        n = self.n_kept
        window = min(self.window, n)
        votes = probs[..., : n - window].sum(axis=(2, 3))  # (B, H, n - window)
        votes = average_pool(votes, self.kernel)
        k = self.layer_budget - window
        if k > 0:
            best = mx.argpartition(-votes, kth=k - 1, axis=-1)[..., :k]
            best = mx.sort(best, axis=-1)  # keep token order (positions ascending)
            recent = mx.broadcast_to(mx.arange(n - window, n), (*best.shape[:2], window))
            index = mx.concatenate([best, recent.astype(best.dtype)], axis=-1)
        else:
            index = mx.broadcast_to(mx.arange(n - window, n), (*votes.shape[:2], window))
        kept = {
            name: mx.take_along_axis(
                self.store[name][:, :, :n],
                index[..., None] if self.store[name].ndim == 4 else index,
                axis=2,
            )
            for name in ("keys", "values", "positions")
        }
        self.capacity = 0
        self.store = {}
        self.n_compressed = index.shape[-1]
        self._ensure_capacity(self.n_compressed)
        for name, array in kept.items():
            self.store[name][:, :, : self.n_compressed] = array
        self.positions_written = self.n_compressed
        # Started, not waited on: the kept tokens are computed (and the chunk's full store
        # released) as soon as the GPU gets there, while the host builds the next layers. A
        # wait here (mx.eval, until session 13) stopped the host at every layer of every
        # prefill chunk: the host's and the GPU's work ran one after the other, 1.19-1.23x
        # fp16's 32K prefill time on the H200 (results/prefill_chunks_h200_s13_32k_start.json).
        mx.async_eval(*self.store.values())
        self.evicted_upto = self.offset

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        if window_size is not None:
            raise QuantizerConfigError(
                "PyramidKVCache: sliding-window attention is not supported; the builder keeps "
                "the model's own cache for sliding-window layers"
            )
        if N == 1 and not return_array:
            return None
        if not return_array:
            return "causal"
        # Columns: the kept tokens (all earlier than the chunk), then the chunk itself.
        n = self.n_kept
        return mx.concatenate(
            [mx.ones((N, n), mx.bool_), mx.arange(N)[:, None] >= mx.arange(N)[None]], axis=1
        )

    def trim(self, n: int) -> int:
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise QuantizerConfigError(f"PyramidKVCache.trim(n={n!r}): allowed is an integer >= 0")
        n = min(n, self.offset)
        recent = self.offset - self.evicted_upto
        if self.evicted_upto and n > recent:
            raise QuantizerConfigError(
                f"PyramidKVCache (layer {self.layer_index}).trim({n}): the prompt's first "
                f"{self.evicted_upto} tokens were compressed (each head kept different ones); "
                f"allowed is trimming at most the {recent} tokens added since"
            )
        self.n_compressed -= n
        self.offset -= n
        self.positions_written = min(self.positions_written, self.n_compressed)
        return n

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        if self.evicted_upto:
            raise QuantizerConfigError(
                f"PyramidKVCache (layer {self.layer_index}) evicted prompt tokens, so mlx-lm's "
                "QuantizedKVCache (which takes positions from its token count) cannot hold it; "
                "do not pass kv_bits together with pyramidkv"
            )
        return super().to_quantized(group_size=group_size, bits=bits)

    # ---- storage and state ------------------------------------------------------------------
    def _store_layout(self):
        from veloxquant_mlx.cache.base import StoreArray

        return [
            StoreArray("keys", axis=2, tokens_per_index=1, dtype=self.dtype, trailing=(-1, self.head_dim)),
            StoreArray("values", axis=2, tokens_per_index=1, dtype=self.dtype, trailing=(-1, self.value_dim)),
            StoreArray("positions", axis=2, tokens_per_index=1, dtype=mx.int32, trailing=(-1,)),
        ]

    def _decode(self):
        return self._full_keys_values()

    @property
    def state(self):
        self._write_positions()  # a saved state holds every kept token's position
        return CompressedKVCache.state.fget(self)

    @state.setter
    def state(self, v):
        CompressedKVCache.state.fset(self, v)
        self.positions_written = self.n_compressed

    def _meta_json(self) -> str:
        meta = json.loads(super()._meta_json())
        meta["pyramidkv"] = {
            "evicted_upto": self.evicted_upto,
            "decoding": self.decoding,
            "attended": self.attended,
            "layer_budget": self.layer_budget,
        }
        return json.dumps(meta, sort_keys=True)

    def _apply_meta(self, text: str) -> list[str]:
        names = super()._apply_meta(text)
        extra = json.loads(text).get("pyramidkv")
        if not isinstance(extra, dict):
            raise QuantizerConfigError("PyramidKVCache state: meta lacks its 'pyramidkv' entry")
        self.evicted_upto = extra["evicted_upto"]
        self.decoding = extra["decoding"]
        self.attended = extra["attended"]
        if extra["layer_budget"] != self.layer_budget:
            raise QuantizerConfigError(
                f"PyramidKVCache state: layer budget {extra['layer_budget']} differs from "
                f"{self.layer_budget} computed from its config"
            )
        return names
