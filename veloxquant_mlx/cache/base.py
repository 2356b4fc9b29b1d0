"""The shared machinery of our compressed caches and the mlx-lm cache contract.

A cache holds two parts, in token order:
  1. the compressed history: positions [0, n_compressed), encoded by the method into arrays
     it names (packed uint32 codes, scales, codebooks, sparse outliers, low-rank factors);
     each array has a token axis and grows by `step` tokens at a time (growth slack), so an
     append writes a slice instead of copying the whole history;
  2. the exact window: positions [n_compressed, offset), the most recent tokens in the
     input dtype, at most `residual_length + block_size - 1` of them between calls.

A method subclass supplies: `block_size` (tokens it encodes at once, e.g. its group size),
`residual_length` (recent tokens kept exact), `_store_layout()` (the arrays, their token axis
and tokens per index along it), `_encode(keys, values)` (a block -> the arrays' slices),
`_decode()` (the whole compressed history -> K, V, used only when unpatched or converting),
`_scores(q)` (q against the compressed keys, one column per token of capacity) and
`_weighted_values(p)` (probabilities over capacity times the compressed values).

The base turns these into `update_and_fetch` (lazily decoded K/V: MLX never computes them when
the patched attention ignores them), `attention` (compressed part + exact window, one softmax),
the state round trip, trim and masks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import ClassVar

import mlx.core as mx
import mlx_lm.models.cache as mlx_lm_cache
from mlx_lm.models.cache import QuantizedKVCache, _BaseCache, create_attention_mask

from veloxquant_mlx.cache import cpu_softmax, fused_decode, window_buffer
from veloxquant_mlx.config.kv_cache_config import KVCacheConfig
from veloxquant_mlx.errors import QuantizerConfigError

# Methods that do not implement the mlx-lm cache contract (see DESIGN.md). Every method we ship
# today does; patch_model_kv_cache refuses the ones listed here before touching make_cache.
STANDALONE_METHODS: frozenset[str] = frozenset()

STATE_FORMAT = 1


@dataclass(frozen=True)
class StoreArray:
    """One array of the compressed history: its shape with `capacity` tokens is
    `shape_for(tokens)`; the token axis is `axis`, `tokens_per_index` tokens share an index
    along it (e.g. 16 two-bit codes per uint32 word, 32 tokens per per-channel scale); it may be
    a fractions.Fraction (32/3 three-bit codes per word) as long as every block of `block_size`
    tokens and every growth step covers a whole number of indices."""

    name: str
    axis: int
    tokens_per_index: int
    dtype: mx.Dtype
    trailing: tuple  # shape without the leading (B, H) and with the token axis as -1 marker


def register_with_mlx_lm(cls: type) -> None:
    """Make `mlx_lm.models.cache.load_prompt_cache` able to rebuild `cls`.

    mlx-lm's loader finds a saved cache's class by name in its own module's globals
    (`globals()[name].from_state(state)`), so every subclass of CompressedKVCache is bound there
    under its class name when it is defined (see __init_subclass__); importing
    `veloxquant_mlx.cache` imports every method module, so loading works after
    `import veloxquant_mlx`. A name mlx-lm already uses for something else is never replaced.
    """
    existing = getattr(mlx_lm_cache, cls.__name__, None)
    if existing is not None and not (isinstance(existing, type) and issubclass(existing, CompressedKVCache)):
        raise QuantizerConfigError(
            f"cache class name {cls.__name__!r} clashes with mlx_lm.models.cache.{cls.__name__}: "
            "rename the class"
        )
    setattr(mlx_lm_cache, cls.__name__, cls)


# A prefill chunk's attention starts evaluating its queries (the model up to this layer) before
# it builds the rest of the graph: mlx-lm evaluates the whole chunk's graph only once it is
# built (one mx.eval per chunk), so the host's building of every layer's cache work (~0.28 ms
# per layer and 2048-token chunk more than the fp16 KVCache's on the H200's host, session 13,
# results/prefill_chunks_h200_s13_*.json) would otherwise run while the GPU idles; started
# here, the GPU computes layer i while the host builds layers i + 1, ... (the queries are
# needed anyway; nothing is computed twice). Measured in one process, fills alternating
# (results/prefill_chunks_h200_s13_32k_start.json, 32K, vs fp16): kivi 1.15x -> 1.04x,
# turboquant_rvq 1.53x -> 1.24x, gear 2.65x -> 1.76x, and lower prefill peaks. 0 builds first
# and evaluates after, as before session 13 (bench --set base.PREFILL_START_QUERIES=0).
PREFILL_START_QUERIES = 1

# A store write that needs more capacity grows the store and writes the blocks in one
# concatenation (`_grow_with`: 2 launches per array for a prefill chunk instead of 4; the same
# stored history). 0: grow, then write in place, as before session 15, for an A/B
# (bench --set / prefill_chunks --alternate base.GROW_WITH_WRITE=0).
GROW_WITH_WRITE = 1

# A decode step (one token) writes its K/V into the window's buffers in place, and the decode
# kernels read the buffers as they are (cache/window_buffer.py): 2 launches per layer and step
# instead of the concatenation's 4 (Nsight on the H200, results/ncu_decode_h200_s20_boost.json:
# ~2.9 us each). 0 (the default): the concatenation, as before session 20. Off because the H200
# run of session 21 found it no faster (results/gpu_speed_h200_s21_32k_inplace.json: per round,
# the plain interval over the in-place one 0.984-1.000 by method, the steps waiting on the host,
# where the buffers' bookkeeping costs what the two launches save); kept for a GPU-bound
# machine's A/B (the `<method>-inplace` bench ablations set it per cache). Where a cache's decode
# kernels run with their launches compiled (fused_decode.COMPILED_LAUNCH, on since session 36)
# the window is written in place whatever this says: fused_decode.writes_window_in_place.
DECODE_WINDOW_IN_PLACE = 0

# The growth's slack past the written blocks (capacity is whole 256-token tiles; a cache keeping
# an exact residual, e.g. turboquant_rvq's 64 tokens, ends each prompt chunk's blocks inside a
# tile) is filled by the concatenation from a broadcast of the written blocks' first entry (a
# view) instead of a zero array: one launch fewer per store array and chunk on CUDA (a zero fill:
# turboquant_rvq's 10 per layer and 2048-token chunk, Nsight's copy_s in
# results/ncu_prefill_chunk_h200_s16.json). Nothing reads the slack as history: attention masks
# every position past n_compressed, and the values there are finite copies of stored ones.
# 0: zeros, as before session 17 (an A/B: prefill_chunks --alternate base.SLACK_FROM_WRITE=0).
SLACK_FROM_WRITE = 1


def _along(ndim: int, axis: int, part: slice) -> tuple:
    """The index of `part` along `axis` of an ndim-dimensional array, everything of the rest."""
    index = [slice(None)] * ndim
    index[axis] = part
    return tuple(index)


class CompressedKVCache(_BaseCache):
    method: ClassVar[str] = ""
    step: ClassVar[int] = 256
    # Set (per instance) by the attention dispatcher of veloxquant_mlx.integration when it hands
    # this cache its own attention; see update_and_fetch.
    _dispatcher = None
    # Writes of the store so far (a flush, a growth, a state load; per instance from the first
    # one on, see _store_written): a decode kernel's launch plan, kept between steps, is valid
    # while this has not moved.
    store_writes = 0
    # Per instance, the in-place decode window whatever DECODE_WINDOW_IN_PLACE says: set by
    # the `<method>-inplace` bench ablations, so one interleaved run times both forms side by
    # side (bench/ablations.py).
    decode_window_in_place = False
    # Per instance, the target warps of the decode kernel's launches (fused_decode.
    # tokens_per_block while fused_decode.planned_attend builds the cache's plan; None: the
    # kernel's own target): set by the `<method>-tw<N>` bench ablations, the same A/B for the
    # launch split.
    decode_target_warps = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        register_with_mlx_lm(cls)

    def __init__(self, config: KVCacheConfig, layer_index: int = 0, n_layers: int = 1):
        if config.method != self.method:
            raise QuantizerConfigError(
                f"{type(self).__name__} needs KVCacheConfig.method={self.method!r}, "
                f"got {config.method!r}"
            )
        self.config = config
        self.layer_index = layer_index
        self.n_layers = n_layers
        self.offset = 0
        self.n_compressed = 0
        self.capacity = 0
        self.window_keys: mx.array | None = None
        self.window_values: mx.array | None = None
        self.store: dict[str, mx.array] = {}
        self.batch_size = 0
        self.n_kv_heads = 0
        self.head_dim = 0
        self.value_dim = 0
        self.dtype: mx.Dtype | None = None
        self._setup()

    # ---- what a method supplies -------------------------------------------------------------
    def _setup(self) -> None:
        """Read the method's parameters from self.config (called by __init__ and from_state)."""

    @property
    def block_size(self) -> int:
        raise NotImplementedError

    @property
    def residual_length(self) -> int:
        return 0

    def _store_layout(self) -> list[StoreArray]:
        raise NotImplementedError

    def _encode(self, keys: mx.array, values: mx.array) -> dict[str, mx.array]:
        raise NotImplementedError

    def _decode(self) -> tuple[mx.array, mx.array]:
        raise NotImplementedError

    def _scores(self, q: mx.array) -> mx.array:
        raise NotImplementedError

    def _weighted_values(self, p: mx.array) -> mx.array:
        raise NotImplementedError

    def _fused_decode(self, queries: mx.array, scale: float):
        """Optional: a decode step's whole attention (queries (B, H_q, 1, D), a compressed
        history and a non-empty window) from a fused kernel (cache/fused_decode.py), or None to
        take the portable _scores/_weighted_values path."""
        return None

    def _check_shape(self, head_dim: int, value_dim: int) -> None:
        """Refuse a head_dim the method cannot take (QuantizerConfigError naming the layer)."""

    def bits_per_element(self) -> float:
        """The method's accounting of stored bits per cached K/V element (compressed part)."""
        raise NotImplementedError

    # ---- the mlx-lm contract ----------------------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self._validate_input(keys, values)
        self._flush()
        if self.window_keys is None:
            self.window_keys, self.window_values = keys, values
        elif keys.shape[2] == 1 and (DECODE_WINDOW_IN_PLACE or self.decode_window_in_place
                                     or fused_decode.writes_window_in_place(self)):
            window_buffer.append_token(self, keys, values)
        else:
            self.window_keys = mx.concatenate([self.window_keys, keys], axis=2)
            self.window_values = mx.concatenate([self.window_values, values], axis=2)
        self.offset += keys.shape[2]
        dispatcher = self._dispatcher
        if dispatcher is not None and getattr(dispatcher, "installed", False):
            # The integration's dispatcher reads the compressed form and ignores the K/V we
            # return: skip even building the (lazy) decode graph. Unpatching clears `installed`.
            return self.window_keys, self.window_values
        return self._full_keys_values()

    def _full_keys_values(self):
        # Lazy: when the dispatcher's attention reads the compressed form these arrays are never
        # evaluated, so nothing is decoded; unpatched, they are the correct K/V.
        if self.n_compressed == 0:
            return self.window_keys, self.window_values
        keys, values = self._decode()
        if self.window_keys is None:
            return keys, values
        return (
            mx.concatenate([keys, self.window_keys], axis=2),
            mx.concatenate([values, self.window_values], axis=2),
        )

    # Bytes of float32 scores one attention tile may hold: a long prefill chunk is split over
    # query rows so the score matrix never exceeds this (mlx-lm's own quantized attention does
    # not tile, which raises its peak memory during long prefills).
    attention_tile_bytes: ClassVar[int] = 64 << 20

    def attention(self, queries: mx.array, scale: float, mask=None, sinks=None) -> mx.array:
        """softmax(q K^T * scale + mask) V over the compressed history and the exact window."""
        if sinks is not None:
            raise QuantizerConfigError(
                f"{type(self).__name__} (layer {self.layer_index}) does not support attention "
                "sinks; the builder keeps the model's own cache for such layers"
            )
        B, n_q_heads, L, D = queries.shape
        rep = self._gqa_repeats(n_q_heads)
        if L == 1 and self.n_compressed and self.window_keys is not None and not isinstance(mask, mx.array):
            out = self._fused_decode(queries, scale)
            if out is not None:
                self._flush()
                return out
        if self.prefill_rows is not None and L >= self.prefill_rows:
            out = self._attend_prefill(queries, scale, mask)
            self._flush()
            return out
        n_cols = (self.capacity if self.n_compressed else 0) + self._window_length()
        row_bytes = B * n_q_heads * n_cols * 4
        rows = max(1, self.attention_tile_bytes // max(row_bytes, 1))
        if rows >= L:
            out = self._attend(queries, scale, mask, rep, self.offset - L)
        else:
            tiles = []
            for start in range(0, L, rows):
                stop = min(L, start + rows)
                tile_mask = mask
                if isinstance(mask, mx.array) and mask.ndim >= 2 and mask.shape[-2] == L:
                    tile_mask = mask[..., start:stop, :]
                tile = self._attend(queries[:, :, start:stop], scale, tile_mask, rep, self.offset - L + start)
                # Evaluate each tile so its score matrix is freed before the next one is built.
                mx.eval(tile)
                tiles.append(tile)
            out = mx.concatenate(tiles, axis=2)
        self._flush()
        return out

    # A chunk of at least this many queries is a prefill: its attention decodes this layer's
    # history once (a transient of one layer that only this layer's attention reads, so MLX
    # can release it once that runs: measured peaks stay below the fp16 cache's, e.g. kivi-2's
    # 16K prefill peak 0.19x, results/kivi_peak.json) and runs the fused mx.fast attention. Per
    # query row that decode is amortised over the whole chunk (rows x history work, where BLAS
    # beats a quantized matmul ~10x on the CPU), and the fused kernel tiles its score matrix
    # itself; on the H200 it turned kivi's 32K prefill from 33 s into 0.74-0.83 s (fp16 cache:
    # 0.42 s warm, results/gpu_speed_h200.json).
    # Decode steps (fewer rows) always read the compressed form. None: never decode.
    prefill_rows: ClassVar[int | None] = 16

    def _attend_prefill(self, queries: mx.array, scale: float, mask) -> mx.array:
        if isinstance(mask, mx.array) and mask.dtype != mx.bool_:
            raise QuantizerConfigError(
                f"{type(self).__name__}: additive float masks are not supported; "
                "pass a boolean mask or 'causal'"
            )
        if mask is None:
            # Like _keep_mask: no mask means causal over the whole history (the queries are
            # the last L cached positions), which is also what the batch cache relies on.
            mask = "causal"
        if PREFILL_START_QUERIES:
            mx.async_eval(queries)
        keys, values = self._prefill_keys_values(queries)
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)

    # Evaluate a prefill chunk's queries (the model up to this layer) before building the
    # layer's decoded history. The decode reads only the already evaluated store, so nothing
    # else orders it after the previous layers' attention: MLX may compute every layer's
    # decoded K/V before any layer's attention runs and hold them all at once. On the H200
    # (8B-shaped llama, 8 layers, bf16, 128K prompt in 2048-token chunks; session 5,
    # results/gpu_speed_h200_s5_128k.json) kivi then peaked 11.35 GB over its start and gear
    # 20.7 GB against fp16's KVCache 9.96 GB, with caches of 0.81 / 1.09 GB against fp16's
    # 4.29 GB; turboquant_rvq, which took this step first, 2.38 GB. On the CPU (a 4-layer
    # random llama, 16K prompt, results/prefill_peak_cpu_s5.json) the step took gear's peak over
    # start from 0.725 to 0.593 GiB, xquant's 0.504 -> 0.488, kvquant's 0.492 -> 0.482, kivi's
    # 0.480 -> 0.497 (fp16's KVCache 0.410); its effect on the H200's peaks is to be measured.
    # Costs one sync per layer per prefill chunk, except where one CUDA kernel builds the
    # history (kivi, xquant, kvquant, turboquant_rvq, gear, minicache's pairs) or a method
    # orders its own decode through mx.depends (gear's portable pieces): their inputs wait for
    # the queries instead (_inputs_after_queries). False only to measure what it saves
    # (bench/prefill_peak.py).
    prefill_eval_queries: ClassVar[bool] = True

    def _prefill_keys_values(self, queries: mx.array) -> tuple[mx.array, mx.array]:
        """Everything cached (history decoded + exact window) in the queries' dtype, for a
        prefill chunk's fused attention, built after the queries are evaluated (see
        prefill_eval_queries). A method whose decode makes large intermediates may override
        it to build them in bounded pieces (turboquant_rvq)."""
        self._order_after_queries(queries)
        keys, values = self._full_keys_values()
        return keys.astype(queries.dtype), values.astype(queries.dtype)

    def _order_after_queries(self, queries: mx.array) -> None:
        if self.prefill_eval_queries and self.n_compressed:
            mx.eval(queries, *[a for a in (self.window_keys, self.window_values) if a is not None])

    def _inputs_after_queries(self, arrays, queries: mx.array) -> list:
        """The same order for a history built by one kernel (the CUDA prefill kernels), without
        the host sync: the kernel's inputs made to wait for the queries (mx.depends). One
        kernel allocates its output only when it runs, so nothing of this layer's history
        exists before the model up to this layer has run: what the sync bounds, bounded."""
        if not self.prefill_eval_queries:
            return list(arrays)
        return list(mx.depends(list(arrays), [queries]))

    def _gqa_repeats(self, n_q_heads: int) -> int:
        """Query heads per kv head, refusing a count that does not divide (or no K/V yet)."""
        if self.n_kv_heads == 0 or n_q_heads % self.n_kv_heads:
            raise QuantizerConfigError(
                f"{type(self).__name__} (layer {self.layer_index}).attention: {n_q_heads} query "
                f"heads for {self.n_kv_heads} kv heads; call update_and_fetch first, and the query "
                "heads must be a multiple of the kv heads"
            )
        return n_q_heads // self.n_kv_heads

    def _window_length(self) -> int:
        return 0 if self.window_keys is None else self.window_keys.shape[2]

    def _slack_keep(self) -> mx.array | None:
        """(capacity,) True for the filled columns of the compressed form; None without slack.
        Cached: it changes only when a block is flushed or the store grows."""
        if self.capacity == self.n_compressed:
            return None
        key = (self.capacity, self.n_compressed)
        cached = self.__dict__.get("_slack_keep_cache")
        if cached is None or cached[0] != key:
            cached = (key, mx.arange(self.capacity) < self.n_compressed)
            self._slack_keep_cache = cached
        return cached[1]

    def _attend(self, queries: mx.array, scale: float, mask, rep: int, first: int) -> mx.array:
        """Attention of the query positions [first, first + L) over everything cached."""
        B, n_q_heads, L, D = queries.shape
        # GQA folded into the rows: (B, H_kv, rep * L, D); query row r*L + i is position i.
        q = (queries * scale).reshape(B, self.n_kv_heads, rep * L, D)
        n_hist = self.capacity if self.n_compressed else 0
        general_mask = isinstance(mask, mx.array)
        parts = []
        if n_hist:
            scores = self._scores(q).astype(mx.float32)
            slack = None if general_mask else self._slack_keep()
            if slack is not None:
                scores = mx.where(slack, scores, mx.finfo(mx.float32).min)
            parts.append(scores)
        if self.window_keys is not None:
            wk = self.window_keys.astype(q.dtype)
            scores = (q @ wk.swapaxes(-1, -2)).astype(mx.float32)
            if not general_mask and L > 1:
                # The history lies wholly before the queries (flushes happen before new tokens
                # arrive), so only the window needs the causal mask.
                window_pos = mx.arange(self.n_compressed, self.n_compressed + self._window_length())
                keep = window_pos[None, :] <= mx.arange(first, first + L)[:, None]
                scores = mx.where(mx.tile(keep, (rep, 1)), scores, mx.finfo(mx.float32).min)
            parts.append(scores)
        scores = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)
        if general_mask:
            keep = self._keep_mask(L, rep, mask, first, n_hist)
            scores = mx.where(keep, scores, mx.finfo(mx.float32).min)
        # On the CPU past a few thousand scores, a softmax whose exp is a polynomial (cpu_softmax).
        probs = cpu_softmax.softmax(scores)
        out = None
        if n_hist:
            out = self._weighted_values(probs[..., :n_hist].astype(q.dtype))
        if self.window_values is not None:
            wv = self.window_values.astype(q.dtype)
            window_out = probs[..., n_hist:].astype(q.dtype) @ wv
            out = window_out if out is None else out + window_out
        return out.reshape(B, n_q_heads, L, -1).astype(queries.dtype)

    def _keep_mask(self, L: int, rep: int, mask, first: int | None = None, n_hist: int | None = None):
        """Boolean (.., rep*L, n_hist + window) of the keys each query row may see, or None.
        The query rows are the positions [first, first + L) (default: the last L tokens); the
        history has n_hist columns (default: the capacity, slack columns masked)."""
        if first is None:
            first = self.offset - L
        if n_hist is None:
            n_hist = self.capacity if self.n_compressed else 0
        n_window = self._window_length()
        # Absolute position of each score column; slack columns get a position past the end.
        cap_pos = mx.arange(n_hist)
        cap_pos = mx.where(cap_pos < self.n_compressed, cap_pos, self.offset + 1)
        key_pos = mx.concatenate([cap_pos, mx.arange(self.n_compressed, self.n_compressed + n_window)])
        query_pos = mx.arange(first, first + L)
        if isinstance(mask, mx.array):
            if mask.dtype != mx.bool_:
                raise QuantizerConfigError(
                    f"{type(self).__name__}: additive float masks are not supported; "
                    "pass a boolean mask or 'causal'"
                )
            # mlx-lm's array masks cover the real tokens [0, offset); map them onto columns.
            cols = mx.where(key_pos < self.offset, key_pos, 0)
            given = mx.take(mask, cols, axis=-1) & (key_pos < self.offset)
            given = mx.broadcast_to(given, (*given.shape[:-2], L, key_pos.shape[0]))
            if given.ndim == 4:  # (B, H_q or 1, L, T): fold GQA rows like the queries
                b, h = given.shape[:2]
                if h == 1:
                    given = mx.tile(given, (1, 1, rep, 1))
                else:
                    given = given.reshape(b, h // rep, rep * L, -1)
            else:
                given = mx.tile(given, (rep, 1))
            return given
        if mask is None and L == 1 and n_hist == self.n_compressed:
            return None
        keep = key_pos[None, :] <= query_pos[:, None]
        return mx.tile(keep, (rep, 1))

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        if window_size is not None:
            raise QuantizerConfigError(
                f"{type(self).__name__}: sliding-window attention is not supported; the "
                "builder keeps the model's own cache for sliding-window layers"
            )
        return create_attention_mask(N, offset=self.offset, return_array=return_array, window_size=None)

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.offset == 0

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        if not isinstance(n, int) or n < 0:
            raise QuantizerConfigError(f"{type(self).__name__}.trim(n={n!r}): allowed is an integer >= 0")
        n = min(self.offset, n)
        keep = self.offset - n
        if keep < self.n_compressed:
            # Re-open the last partial block: decode it into the window, then keep whole blocks.
            keys, values = self._full_keys_values()
            whole = (keep // self.block_size) * self.block_size
            self.n_compressed = whole
            self.window_keys = mx.contiguous(keys[:, :, whole:keep])
            self.window_values = mx.contiguous(values[:, :, whole:keep])
            mx.eval(self.window_keys, self.window_values)
        else:
            cut = keep - self.n_compressed
            self.window_keys = mx.contiguous(self.window_keys[:, :, :cut])
            self.window_values = mx.contiguous(self.window_values[:, :, :cut])
        if self.window_keys is not None and self.window_keys.shape[2] == 0 and keep == 0:
            self.window_keys = self.window_values = None
        self.offset = keep
        return n

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.store.values()) + window_buffer.nbytes(self)

    def window_buffers(self):
        """(keys buffer, values buffer, filled rows) while decode steps write the window in
        place (window_buffer.py), else None: what the decode kernels read (fused_decode.window_inputs)."""
        return window_buffer.current(self)

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> QuantizedKVCache:
        """mlx-lm's kv_bits path: hand over the whole history, decoded then re-quantized."""
        quant = QuantizedKVCache(group_size=group_size, bits=bits)
        if self.offset:
            keys, values = self._full_keys_values()
            quant.update_and_fetch(keys, values)
        return quant

    @classmethod
    def merge(cls, caches):
        """mlx-lm's batched generation merges entry i of every sequence's cache list: one
        single-sequence cache per row inside a BatchCompressedKVCache (cache/batch.py)."""
        from veloxquant_mlx.cache.batch import BatchCompressedKVCache

        return BatchCompressedKVCache.merge(caches)

    # ---- state --------------------------------------------------------------------------------
    @property
    def meta_state(self):
        return (self._meta_json(),)

    @meta_state.setter
    def meta_state(self, v):
        self._apply_meta(v[0])

    def _meta_json(self) -> str:
        return json.dumps(
            {
                "format": STATE_FORMAT,
                "class": type(self).__name__,
                "config": self.config.to_dict(),
                "layer_index": self.layer_index,
                "n_layers": self.n_layers,
                "offset": self.offset,
                "n_compressed": self.n_compressed,
                "capacity": self.capacity,
                "shape": [self.batch_size, self.n_kv_heads, self.head_dim, self.value_dim],
                "dtype": None if self.dtype is None else str(self.dtype).split(".")[-1],
                "store": sorted(self._state_arrays()),
            },
            sort_keys=True,
        )

    def _apply_meta(self, text: str) -> list[str]:
        try:
            meta = json.loads(text)
        except (TypeError, ValueError) as exc:
            raise QuantizerConfigError(f"{type(self).__name__} state: meta is not JSON ({exc})") from None
        if meta.get("format") != STATE_FORMAT or meta.get("class") != type(self).__name__:
            raise QuantizerConfigError(
                f"{type(self).__name__} state: written by class {meta.get('class')!r} format "
                f"{meta.get('format')!r}; allowed is class {type(self).__name__!r} format {STATE_FORMAT}"
            )
        self.config = KVCacheConfig.from_dict(meta["config"])
        if self.config.method != self.method:
            raise QuantizerConfigError(
                f"{type(self).__name__} state: config method {self.config.method!r}, expected {self.method!r}"
            )
        self.layer_index, self.n_layers = meta["layer_index"], meta["n_layers"]
        self.offset, self.n_compressed = meta["offset"], meta["n_compressed"]
        self.capacity = meta["capacity"]
        self.batch_size, self.n_kv_heads, self.head_dim, self.value_dim = meta["shape"]
        self.dtype = None if meta["dtype"] is None else getattr(mx, meta["dtype"])
        self._accepted_input = None  # the shapes checked against the old fields no longer hold
        self._setup()
        return meta["store"]

    def _state_arrays(self) -> dict[str, mx.array]:
        """The arrays a saved state carries: the store, plus what a cross-layer cache reads
        from a partner layer (each layer's state must load on its own, as mlx-lm loads them)."""
        return self.store

    @property
    def state(self):
        arrays = self._state_arrays()
        names = sorted(arrays)
        return (self._meta_json(), self.window_keys, self.window_values, *[arrays[n] for n in names])

    @state.setter
    def state(self, v):
        if not isinstance(v, (list, tuple)) or len(v) < 3:
            raise QuantizerConfigError(
                f"{type(self).__name__} state must be (meta, window_keys, window_values, *arrays)"
            )
        names = self._apply_meta(v[0])
        if len(v) != 3 + len(names):
            raise QuantizerConfigError(
                f"{type(self).__name__} state has {len(v) - 3} arrays, meta names {len(names)}"
            )
        self.window_keys, self.window_values = v[1], v[2]
        self.store = dict(zip(names, v[3:]))
        self._store_written()

    def _split_state(self, v, extra_counts: tuple[int, ...], layout: str):
        """A method whose state adds entries after the base's (meta, window_keys, window_values,
        *store arrays): (the base's part, the added entries). `extra_counts` are the numbers of
        added entries accepted (older formats had fewer); anything else is refused, naming
        `layout` (the whole tuple the method writes)."""
        try:
            n_arrays = len(json.loads(v[0])["store"])
        except (TypeError, ValueError, KeyError, IndexError):
            n_arrays = None
        extra = None if n_arrays is None else len(v) - 3 - n_arrays
        if not isinstance(v, (list, tuple)) or extra not in extra_counts:
            got = f"{len(v)} entries" if isinstance(v, (list, tuple)) else type(v).__name__
            raise QuantizerConfigError(
                f"{type(self).__name__} state must be {layout} ({', '.join(map(str, extra_counts))} "
                f"entries after the store arrays); got {got}"
            )
        return v[: 3 + n_arrays], tuple(v[3 + n_arrays :])

    @classmethod
    def from_state(cls, state):
        obj = cls.__new__(cls)
        obj.state = state
        return obj

    # ---- internals ----------------------------------------------------------------------------
    def _validate_input(self, keys, values) -> None:
        # A decode step's keys / values have the shapes and dtypes of the last step's: the full
        # check below ran for those (each of its ~10 comparisons is host time at every layer and
        # step; on the H200's host the check took ~2.6 us per call). Anything else, full check.
        if type(keys) is mx.array and type(values) is mx.array:
            signature = (keys.shape, values.shape, keys.dtype, values.dtype)
            if signature == self.__dict__.get("_accepted_input"):
                return
        else:
            signature = None
        self._full_input_check(keys, values)
        self._accepted_input = signature

    def _full_input_check(self, keys, values) -> None:
        name = type(self).__name__
        for label, a in (("keys", keys), ("values", values)):
            if not isinstance(a, mx.array) or a.ndim != 4:
                raise QuantizerConfigError(
                    f"{name}.update_and_fetch: {label} must be an mx.array of shape "
                    f"(batch, kv_heads, tokens, head_dim), got {getattr(a, 'shape', type(a).__name__)}"
                )
            if a.dtype not in (mx.float16, mx.bfloat16, mx.float32):
                raise QuantizerConfigError(
                    f"{name}.update_and_fetch: {label} dtype {a.dtype} is invalid: allowed is "
                    "float16, bfloat16 or float32"
                )
        if keys.shape[:3] != values.shape[:3]:
            raise QuantizerConfigError(
                f"{name}.update_and_fetch: keys {keys.shape} and values {values.shape} differ in "
                "batch, heads or tokens"
            )
        B, H, _, D = keys.shape
        if self.dtype is None:
            self._check_shape(D, values.shape[3])
            self.batch_size, self.n_kv_heads, self.head_dim, self.value_dim = B, H, D, values.shape[3]
            self.dtype = keys.dtype
        elif (B, H, D, values.shape[3]) != (self.batch_size, self.n_kv_heads, self.head_dim, self.value_dim):
            raise QuantizerConfigError(
                f"{name} (layer {self.layer_index}) holds batch={self.batch_size} "
                f"kv_heads={self.n_kv_heads} head_dim={self.head_dim}; got keys {keys.shape}, "
                f"values {values.shape}"
            )

    def _flush(self) -> None:
        """Encode whole blocks of the window beyond the exact residual into the store."""
        if self.window_keys is None:
            return
        n_window = self.window_keys.shape[2]
        n = ((n_window - self.residual_length) // self.block_size) * self.block_size
        if n <= 0:
            return
        self._append_compressed(self._encode(self.window_keys[:, :, :n], self.window_values[:, :, :n]), n)

    def _append_compressed(self, encoded: dict[str, mx.array], n: int) -> None:
        """Write the encoded first n window tokens into the store (growing it) and drop them
        from the exact window. Cross-layer caches call it with blocks encoded by a pair."""
        if GROW_WITH_WRITE and self.capacity and self.n_compressed + n > self.capacity:
            self._grow_with(encoded, n)
        else:
            self._ensure_capacity(self.n_compressed + n)
            self._write_in_place(encoded)
        self._store_written()
        self.n_compressed += n
        if self.window_keys.shape[2] == n:
            self.window_keys = self.window_values = None
        else:
            # A slice is a view that keeps the whole chunk's buffer alive: copy the remainder.
            self.window_keys = mx.contiguous(self.window_keys[:, :, n:])
            self.window_values = mx.contiguous(self.window_values[:, :, n:])

    def _write_in_place(self, encoded: dict[str, mx.array]) -> None:
        """Write encoded blocks at n_compressed into the store, whose capacity holds them."""
        for spec in self._store_layout():
            start = self.n_compressed // spec.tokens_per_index
            stop = start + encoded[spec.name].shape[spec.axis]
            store = self.store[spec.name]
            store[_along(store.ndim, spec.axis, slice(start, stop))] = encoded[spec.name]

    def _grow_with(self, encoded: dict[str, mx.array], n: int) -> None:
        """Grow the store to hold n more tokens and write the encoded blocks in the same
        concatenation: [the filled part, the encoded blocks, slack up to the new capacity (a
        broadcast of the blocks' first entry: SLACK_FROM_WRITE)]. Growing first and then writing
        costs per array a zero fill of the growth, two copies (old, growth) and the write's
        copy: 4 launches; this is 2 when the encoded blocks end at the new capacity (a prefill
        chunk of whole growth steps) and 3 otherwise (and a zero fill with SLACK_FROM_WRITE = 0).
        On MLX's CUDA backend every launch is host time too (bench/prefill_chunks.py: kvquant's
        host ~11 ms per 8-layer 2048-token chunk against fp16's 0.9). What lay past n_compressed
        (stale blocks after a trim) is not carried: nothing reads it (the attention masks every
        position past the history)."""
        new_capacity = self._grown_capacity(self.n_compressed + n)
        for spec in self._store_layout():
            old = self.store[spec.name]
            axis = spec.axis % old.ndim
            start = self.n_compressed // spec.tokens_per_index
            shape = list(old.shape)
            part = encoded[spec.name]
            shape[axis] = part.shape[axis]
            # Concatenation neither broadcasts nor casts as the slice write did: match both.
            parts = [mx.broadcast_to(part, shape).astype(spec.dtype)]
            if start:
                parts.insert(0, old[_along(old.ndim, axis, slice(0, start))])
            slack = new_capacity // spec.tokens_per_index - start - shape[axis]
            if slack:
                shape[axis] = slack
                if SLACK_FROM_WRITE:
                    parts.append(mx.broadcast_to(parts[-1][_along(old.ndim, axis, slice(0, 1))], shape))
                else:
                    parts.append(mx.zeros(shape, spec.dtype))
            self.store[spec.name] = mx.concatenate(parts, axis=axis)
        self.capacity = new_capacity

    def _grown_capacity(self, tokens: int) -> int:
        """The capacity that holds `tokens`: whole growth steps (the fused decode reads whole
        tiles of 256 tokens)."""
        step = max(self.step, self.block_size)
        return ((tokens + step - 1) // step) * step

    def _store_written(self) -> None:
        """Count a write of the store and drop the decode kernel's launch plan, which holds the
        store's arrays (kept, a plan would pin a grown store's old buffers until the next
        decode step, e.g. through a whole prefill)."""
        self.store_writes += 1
        self.__dict__.pop("_fused_plan", None)

    def _ensure_capacity(self, tokens: int) -> None:
        if tokens <= self.capacity:
            return
        new_capacity = self._grown_capacity(tokens)
        for spec in self._store_layout():
            shape = [self.batch_size, self.n_kv_heads, *spec.trailing]
            axis = spec.axis % len(shape)
            grow = (new_capacity - self.capacity) // spec.tokens_per_index
            shape[axis] = grow
            extra = mx.zeros(shape, spec.dtype)
            old = self.store.get(spec.name)
            self.store[spec.name] = extra if old is None else mx.concatenate([old, extra], axis=axis)
        self._store_written()
        self.capacity = new_capacity
