"""Batched generation (mlx-lm's BatchGenerator / batch_generate) with our compressed caches.

How mlx-lm 0.32.2 batches: every sequence gets its own cache list (`make_prompt_cache`), then
`PromptProcessingBatch` merges entry i of every list with `type(entry).merge(list)`; prompts of
different lengths are right-padded with `prepare(lengths=, right_padding=)` and `finalize()`d
after the prefill; finished sequences leave with `filter(keep)`, new ones join with
`extend(other)`, `extract(i)` hands one sequence's cache back. mlx-lm's BatchKVCache keeps one
padded (B, H, T, D) tensor with left padding and per-row offsets.

We batch by composition instead: `BatchCompressedKVCache` holds one single-sequence
CompressedKVCache per row and never stores a padding token. That keeps every method's block
layout untouched (a left pad that is not a multiple of the block size cannot be added to or
removed from quantized groups without re-encoding them) and makes filter / extend / extract
list operations. The price: attention runs once per row (our attention is called per sequence,
through the dispatcher), not as one batched kernel.

- update_and_fetch(keys (B, H, L, D)): row i's real tokens go to its cache: all L, or during a
  right-padded prefill only the first `lengths[i]` still due (a left pad given to prepare is
  skipped the same way).
- attention (through veloxquant_mlx.integration.dispatch): row i's queries over row i's cache,
  causal, for the rows that were real; padded rows get zeros (mlx-lm discards their outputs).
  The mask the model passes is ignored: every layer we replace is plain causal attention
  (cache/layer_plan.py), so each row's causal mask over its own cache is the whole mask.
- offset: an (B,) array of each row's token count, which the model's RoPE reads.
- The dispatcher is required: without it the model would attend over the K/V returned here,
  which are not the rows' histories. `merge` refuses (before any model call) a cache whose
  layer's model module does not have the dispatcher installed (gemma2, an unpatched model).

Deviations / limits: `merge` copies caches that already hold tokens (mlx-lm promises not to
update given prompt caches in place) and refuses non-empty cross-layer caches (a per-layer copy
would cut them off their coordinator); the batch cache's state cannot be saved as a whole
(extract a row first); `trim` is not supported; deepcopy shares the rows (see __deepcopy__).
"""

from __future__ import annotations

import copy

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache

from veloxquant_mlx.cache.base import CompressedKVCache
from veloxquant_mlx.errors import QuantizerConfigError


def _copy_row(cache: CompressedKVCache) -> CompressedKVCache:
    """A copy whose arrays are new (the base writes into its store arrays in place)."""
    new = copy.copy(cache)
    new.store = {name: mx.array(a) for name, a in cache.store.items()}
    if cache.window_keys is not None:
        new.window_keys, new.window_values = mx.array(cache.window_keys), mx.array(cache.window_values)
    return new


def _dispatcher_installed(cache) -> bool:
    from veloxquant_mlx.integration import dispatch  # integration imports the cache package

    module = getattr(cache, "attention_module", None)
    return module is not None and module in dispatch.installed_modules()


class BatchCompressedKVCache(_BaseCache):
    def __init__(self, caches: list):
        self.caches = list(caches)
        self._skip = None  # per row: padding tokens still to drop (left padding)
        self._due = None  # per row: real tokens still due in a padded prefill (None: all real)
        self._rows = [(0, 0)] * len(self.caches)  # per row: [start, stop) of the last update
        self._dispatcher = None

    # ---- building ----------------------------------------------------------------------------
    @classmethod
    def merge(cls, caches: list) -> "BatchCompressedKVCache":
        if not caches:
            raise QuantizerConfigError("BatchCompressedKVCache.merge: no caches to merge")
        first = type(caches[0])
        rows = []
        for i, cache in enumerate(caches):
            if type(cache) is not first or not isinstance(cache, CompressedKVCache):
                raise QuantizerConfigError(
                    f"BatchCompressedKVCache.merge: entry {i} is {type(cache).__name__}, entry 0 "
                    f"is {first.__name__}: allowed is one CompressedKVCache class per layer"
                )
            if not _dispatcher_installed(cache):
                raise QuantizerConfigError(
                    f"batched generation with {first.__name__} (layer {cache.layer_index}) needs "
                    "veloxquant's attention dispatcher in the layer's model module "
                    f"({getattr(cache, 'attention_module', 'unknown')}), which is not installed: "
                    "patch the model with patch_model_kv_cache (a model that computes attention "
                    "itself, like gemma2, cannot batch with our caches)"
                )
            if cache.empty():
                rows.append(cache)
                continue
            if cache.batch_size != 1:
                raise QuantizerConfigError(
                    f"BatchCompressedKVCache.merge: entry {i} holds batch={cache.batch_size}; "
                    "allowed is one sequence per cache"
                )
            if getattr(cache, "coordinator", None) is not None:
                raise QuantizerConfigError(
                    f"BatchCompressedKVCache.merge: entry {i} ({first.__name__}) holds tokens and "
                    "shares a cross-layer coordinator; a per-layer copy would lose it: start "
                    "batched generation from empty caches"
                )
            # mlx-lm does not update given prompt caches in place: keep the caller's intact.
            rows.append(_copy_row(cache))
        return cls(rows)

    def __deepcopy__(self, memo):
        # mlx-lm's PromptProcessingBatch.split deep-copies the batch and then filters the two
        # copies to disjoint rows, so the rows themselves are shared, not copied: each ends up
        # in exactly one batch, and cross-layer rows keep their coordinator (a copy would point
        # at the originals).
        new = copy.copy(self)
        new.caches = list(self.caches)
        new._rows = list(self._rows)
        new._skip = None if self._skip is None else list(self._skip)
        new._due = None if self._due is None else list(self._due)
        return new

    # ---- what BatchGenerator calls ----------------------------------------------------------
    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        n = len(self.caches)
        if left_padding is not None:
            self._skip = [int(p) for p in left_padding]
        if lengths is not None and right_padding is not None and max(right_padding) > 0:
            self._due = [int(l) for l in lengths]
        for name, value in (("left_padding", self._skip), ("lengths", self._due)):
            if value is not None and len(value) != n:
                raise QuantizerConfigError(
                    f"BatchCompressedKVCache.prepare({name}={value}): allowed is one entry per "
                    f"row ({n} rows)"
                )

    def finalize(self):
        self._skip = None
        self._due = None

    def filter(self, batch_indices):
        keep = [int(i) for i in (batch_indices.tolist() if isinstance(batch_indices, mx.array) else batch_indices)]
        self.caches = [self.caches[i] for i in keep]
        self._rows = [self._rows[i] for i in keep]
        for name in ("_skip", "_due"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, [value[i] for i in keep])

    def extend(self, other: "BatchCompressedKVCache"):
        if not isinstance(other, BatchCompressedKVCache):
            raise QuantizerConfigError(
                f"BatchCompressedKVCache.extend: got {type(other).__name__}; allowed is "
                "BatchCompressedKVCache"
            )
        if self._due is not None or other._due is not None:
            raise QuantizerConfigError("BatchCompressedKVCache.extend during a padded prefill")
        self.caches.extend(other.caches)
        self._rows.extend(other._rows)

    def extract(self, idx: int) -> CompressedKVCache:
        return self.caches[idx]

    # ---- the cache contract -----------------------------------------------------------------
    @property
    def offset(self) -> mx.array:
        return mx.array([c.offset for c in self.caches])

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        B, _, L, _ = keys.shape
        if B != len(self.caches):
            raise QuantizerConfigError(
                f"BatchCompressedKVCache: keys hold {B} rows, the batch has {len(self.caches)}"
            )
        if not all(_dispatcher_installed(c) for c in self.caches[:1]):
            raise QuantizerConfigError(
                "BatchCompressedKVCache needs veloxquant's attention dispatcher (it was removed: "
                "the model was unpatched during batched generation)"
            )
        for i, cache in enumerate(self.caches):
            start = 0
            if self._skip is not None:
                start = min(self._skip[i], L)
                self._skip[i] -= start
            stop = L
            if self._due is not None:
                stop = start + min(self._due[i], L - start)
                self._due[i] -= stop - start
            self._rows[i] = (start, stop)
            if stop > start:
                cache.update_and_fetch(keys[i : i + 1, :, start:stop], values[i : i + 1, :, start:stop])
        # Placeholders of the right shape: the dispatcher's attention never reads them.
        return keys, values

    def attention(self, queries: mx.array, scale: float, mask=None, sinks=None) -> mx.array:
        B, n_q_heads, L, _ = queries.shape
        outputs = []
        for row, (cache, (start, stop)) in enumerate(zip(self.caches, self._rows)):
            if self._dispatcher is not None:
                cache._dispatcher = self._dispatcher
            if stop <= start:
                outputs.append(None)
                continue
            out = cache.attention(queries[row : row + 1, :, start:stop], scale=scale,
                                  mask=None, sinks=sinks)
            if start or stop < L:
                out = mx.pad(out, [(0, 0), (0, 0), (start, L - stop), (0, 0)])
            outputs.append(out)
        value_dim = next((o.shape[-1] for o in outputs if o is not None), queries.shape[-1])
        outputs = [mx.zeros((1, n_q_heads, L, value_dim), queries.dtype) if o is None else o for o in outputs]
        return mx.concatenate(outputs, axis=0)

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        # Our attention builds each row's causal mask itself (see the module docstring).
        return None if N == 1 else "causal"

    @property
    def state(self):
        return [a for c in self.caches for a in c.state]

    @state.setter
    def state(self, v):
        raise QuantizerConfigError(
            "BatchCompressedKVCache: a batch cache cannot be restored as a whole; save and load "
            "each row's cache (extract(i))"
        )

    @property
    def batch_size(self) -> int:
        return len(self.caches)

    def size(self) -> int:
        return max((c.offset for c in self.caches), default=0)

    def empty(self) -> bool:
        return all(c.empty() for c in self.caches)

    def is_trimmable(self) -> bool:
        return False

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches)
