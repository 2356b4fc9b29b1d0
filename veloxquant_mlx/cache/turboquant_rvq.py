"""TurboQuant with a residual stage: rotated, scalar-quantized keys and values.

Zandieh, Daliri, Hadian, Mirrokni, "TurboQuant: Online Vector Quantization with Near-optimal
Distortion Rate", arXiv 2504.19874 (2025). TurboQuant rotates each vector randomly, so every
coordinate follows (nearly) the same known distribution, then quantizes the coordinates with a
scalar quantizer fitted to it (TurboQuant_mse). TurboQuant_prod spends b-1 bits on that stage and
1 bit on the residual (a QJL sign sketch of what the first stage missed, plus the residual's
norm) to make inner products unbiased.

What this cache stores, per key/value vector of head_dim d, for `bits` = b total:
  * rotation: y = H (s * x) / sqrt(d), s random signs from config.seed and the layer index
    (cache/hadamard.py); keys are first centered by a per-(head, channel) mean taken from the
    first block the cache encodes (see deviations);
  * stage 1 (b-1 bits): uniform codes of y, one fp16 scale and zero per group of
    `group_size` (= min(64, d)) coordinates, packed by `mx.quantize` into uint32 words;
  * stage 2 (1 bit, the residual): the sign of r = y - stage1(y) per coordinate, packed into
    uint32 words, and one fp16 magnitude per vector, a = mean |r| (the least-squares scale for
    a sign code), so the residual is read back as a * sign(r);
  * b = 1 has no stage 1: the sign stage then quantizes y itself (TurboQuant_prod at 1 bit).
`bit_width_inlier` (1..4, or one value per layer) is the TOTAL bits per coordinate of the codes
across both stages; `key_bits` / `value_bits` override it for keys or values. Side data add
32 / group_size + 16 / d bits per coordinate (0.75 at d = 64), see `bits_per_element`.
The most recent `residual_length` tokens (plus up to block_size - 1 not yet encoded) are kept
exact in the input dtype by the base class. The first token of the sequence (the attention sink,
`exact_sink_tokens`) is read back exactly: its codes stay in the store, and a float32 correction
(exact - decoded, d values per head for keys and for values) is added to its score column and to
the weighted values.

Attention reads the compressed form. The rotation is orthogonal, so q . k = (R q) . (R k): the
query is rotated once per step and scored against both stages' codes (keys (B, H, T, d) grouped
along d, transpose=True); the probabilities multiply the rotated values the same way and the sum
is rotated back once. The uniform stage runs through `mx.quantized_matmul` at its own width (2 or
3 bits). The sign stage is the affine 1-bit code with scale 2a and zero -a, but no 1-bit kernel
is used (MLX's CUDA backend has none): cache/sign_plane.py widens its words per call into the
same 0/1 codes packed 2 bits wide (scores) or 4 bits wide (weighted sum, full decode), which the
affine kernels of every backend read, bit for bit the values the 1-bit kernels read. The key
mean adds q . mean to every compressed score (a constant per query row, which the softmax across
compressed and exact tokens still needs because the exact window is not centered). On the CPU
the products run in float32 whatever the query dtype (its affine kernels are ~10x slower in
bf16), elsewhere in the query dtype; and on the CPU no affine kernel reads the stages: their
codes are read as float32 planes for BLAS products (cache/unpacked_products.py: session 38's
whole-row unpacking made the scores 1.55x and the weighted values 1.8x faster than
mx.quantized_matmul, session 39's planes another 1.2x and 1.45x at SmolLM2's shape and 2048
tokens, 1.7x and 2.3x at the 8B shape and 8192 tokens in bf16).

Memory of a prefill chunk. A chunk of >= prefill_rows queries does not read the compressed form
(CompressedKVCache._attend_prefill): it decodes the layer's history to K/V in the queries' dtype
and runs mx.fast attention over it. Decoded as one lazy graph (the base class's path, used up
to commit 4e10821), that decode held float32 intermediates of the whole history at once (both
stages, the widened sign plane, their sum, the unrotation, the key mean, the sink
concatenation, the cast, the concatenation with the window): one layer's decode added 12.1-12.3x
the history's fp16 K/V (bf16 model, 8 kv heads, d 128, 4K-32K tokens, CPU) against 6.8-7.0x for
kivi's, and each layer's decode reads only the already evaluated store, so nothing ordered it
after the previous layers' attention. On the H200 (8 layers, 32K prompt in 2048-token chunks)
turboquant_rvq peaked at 11.2-12.5 GiB, fp16's KVCache at 8.39 and kivi at 8.46-8.73
(results/gpu_speed_h200_s3.json). `_prefill_keys_values` now
  1. evaluates the queries first, so the model up to this layer (and so the previous layers'
     attention, which frees their decoded K/V) has run before this layer decodes;
  2. allocates the result once in the queries' dtype and fills it piece by piece
     (`prefill_decode_bytes` = 16 MiB of float32 per piece; keys, then values), evaluating each
     piece before the next is built, so the float32 intermediates exist for one piece only and
     no concatenation copies the result again.
The transient is then the result (the history's K/V in the model dtype: what an fp16 cache holds
for that layer anyway) plus one piece's intermediates (~100 MiB on the CPU, whose 3-bit
dequantize makes ~4x its output in temporaries; not growing with the context): 1.96x the
history's fp16 K/V at 32K (251 MiB, kivi 893 MiB), 2.9x at 16K, 8.6x at 4K (137 MiB, kivi 109
MiB). A whole prefill (random llama, 4 layers of 32 query / 8 kv heads, d 128, bf16, 2048-token
chunks, mx.fast attention replaced by a stand-in for a fused kernel, since the CPU's materialises
its score matrix) peaked over its start at 32K tokens: before 1.756 GiB, after 0.432, fp16
KVCache 0.723, kivi 1.065; at 16K: 0.821, 0.298, 0.412, 0.480, and with the pieces but without
step 1 0.434; at 8K: 0.354, 0.230, 0.254, 0.256, 0.273 (python -m
veloxquant_mlx.bench.prefill_peak, results/turboquant_rvq_prefill_peak_cpu.json and _32k.json). The values are bit-identical to the one-graph
decode (every op acts per token; tests/cache/test_turboquant_rvq_prefill_peak.py). The cost is one
mx.eval per piece and one for the queries: on a GPU a sync each, 9 per layer per chunk at 16K
history tokens (8 kv heads, d 128); its H200 time was not measured (no device this session).
Session 6 measured turboquant_rvq's prefill on the H200 at 2.43x fp16's (8 layers, 32K prompt):
~4 ms per layer and chunk above fp16, far more than the decode's bytes. On MLX's CUDA backend the
pieces and both syncs are now replaced by one kernel per layer and chunk
(cache/turboquant_prefill_kernel.py: the same values bit for bit under the CPU emulation, its
inputs ordered after the queries by mx.depends); its GPU time is not measured yet.

Encoding and the prefill decode run through mx.compile (`_compiled_encoder`,
`_compiled_decoder`, module end): the elementwise work between mx.quantize, mx.dequantize, the
Hadamard transform and the reductions fuses (why that is exact, and the one case left
uncompiled on a GPU: the comment above `stage_names`), and the stored bits and decoded K/V are
those of the uncompiled ops of main 714de0c (tests/cache/test_turboquant_rvq_encoder_identity.py
against tests/cache/turboquant_rvq_reference.py). Lazy graph, one layer of 8 kv heads x d 128,
bf16, non-view nodes before -> after: a later 2048-token chunk's `_encode` 58 -> 38 (4 bits),
112 -> 62 (3 bits); the first chunk's (also the key mean and the sink deltas) 160 -> 140, 268
-> 218; one 4096-token key piece of the prefill decode 44 -> 28, 71 -> 40. On the CPU many of
those nodes are MLX's elementwise build of mx.dequantize; on a GPU, where quantize, dequantize
and the transform are single kernels, what fuses is the side data's casts, the sign plane's
affine terms, the residual and |r|, and the decode's stage sum, sign multiply, key mean, sink
correction and cast. CPU time does not move (tests/cache/bench_turboquant_rvq_encoder.py, 15
rounds in rotating order, 2-core machine under load 6-21, medians ms, reference of 714de0c ->
compiled; results/turboquant_rvq_encoder_cpu_s4.json): later chunk's `_encode` 88.6 -> 89.0 (4
bits), 63.2 -> 61.8 (3 bits); first chunk's 81.9 -> 90.3 and 62.6 -> 67.3 (slower: the same
code uncompiled took 82.0 / 62.6; not understood, once per layer and sequence); prefill decode
of 16320 tokens 640 -> 639 and 420 -> 417, its peak unchanged (186.9 / 152.9 MiB). bench.encode's
fill, 2 layers x 8192 tokens, 1.44 -> 1.26 s (medians of 3 alternating runs under load 22-44,
results/turboquant_rvq_encode_fill_cpu_s4.json). Each prefill piece is still one mx.eval (a GPU
sync); what the compiled forms save on the H200 was not measured (no device this session).

Deviations from the paper:
  * randomized Hadamard instead of a dense random rotation (the paper allows any random
    rotation; this one is O(d log d) and needs no d x d matrix);
  * stage 1 is uniform with a per-group scale and zero, not a Lloyd-Max codebook scaled by the
    vector norm: on SmolLM2 keys/values (rotated) 4-bit uniform g64 had relative MSE 0.0075/0.0082
    against 0.0087/0.0091 for 4-bit Lloyd-Max-by-norm at 0.25 fewer side bits, and uniform codes
    run through `mx.quantized_matmul` instead of a gather;
  * the residual stage takes signs in the rotated basis (not a fresh Gaussian projection) and
    scales them by mean |r| (least-squares, slightly biased) instead of the unbiased
    sqrt(pi/2) / d * |r|: lower variance, which the softmax punishes more than bias;
  * keys are centered by a per-channel mean before rotation. Real keys carry a large constant
    offset (62% of SmolLM2's key energy), which costs quantization range on every token but adds
    only a per-query constant to the scores; the mean is held exactly, so decoding is unchanged;
  * the attention sink is kept exact (not in the paper; KVQuant and StreamingLLM do the same):
    on SmolLM2 (DESIGN.md protocol, simulated caches returning exactly what this one decodes)
    turboquant_rvq-4 had KL 0.0127 / top-1 91.2%, of which keys alone 0.0117 and values alone
    0.0007; with token 0 exact the same codes gave KL 0.0022 / top-1 98.2%
    (results/turboquant_rvq_quality_attribution.json), and this cache measured KL 0.0022 /
    top-1 98.2% / PPL 16.525 vs 16.523 (results/turboquant_rvq_quality.json). Token 0's key
    lies ~1.5-2x further from the key mean than a typical key in SmolLM2's deeper layers (so
    its codes err more) and it receives most of the attention mass, so its score error moves
    the whole softmax;
  * (implementation, not the paper) the sign plane is stored 1 bit per coordinate but read at 2
    or 4 bits by the affine kernels of a GPU backend's portable path (MLX's CUDA backend has no
    1-bit kernels; on the CPU since session 38 the plane is unpacked to floats in chunks of
    at most 4 MiB instead, cache/unpacked_products.py): each attention call widens one layer's
    sign words, a transient of 2 + 4 bits per compressed element (keys, values) freed with the
    call, never a float copy of the history (4 MiB + 8 MiB for 16K tokens x 8 kv heads x d 128,
    ~2x that while the compiled widening runs; that layer's store is 20 MiB, its fp16 K/V 64
    MiB); past 64 MiB of widened words per product (128K tokens of that shape) it is made and
    evaluated in chunks, so it stops growing with the context. Measured peak added by one such
    decode step: 12.6 / 47.8 MiB at 4K / 16K tokens (5.4 / 18.1 MiB with the 1-bit kernels).
    Weighed against: storing the plane 2 bits wide (twice its bytes: 0.34x fp16 instead of
    0.31x at 4 bits); reading the stored words in place at a supported width (not possible: see
    sign_plane.py); expanding them to +-1 floats for a regular matmul (same CPU speed, but a
    tokens x d float transient, 148 MiB per step at 16K in float32, which lazy evaluation keeps
    whole unless every chunk is evaluated on its own: a sync per chunk on a GPU). CPU time of
    that step against the 1-bit kernels: 0.98-1.0x in float32, 0.16-0.17x in bf16 (float32
    compute) at 4K and 16K tokens (results/turboquant_rvq_step_cpu.json).
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from veloxquant_mlx.cache import fused_decode_rotated, prefill_pieces, turboquant_prefill_kernel
from veloxquant_mlx.cache.base import CompressedKVCache, StoreArray
from veloxquant_mlx.cache.hadamard import fast_transform_available, is_power_of_two, random_signs, rotate, unrotate
from veloxquant_mlx.cache.packing import pack_codes
from veloxquant_mlx.cache.sign_plane import compute_dtype, sign_scores, sign_values, sign_weighted_sum
from veloxquant_mlx.cache.split_reduction import quantized_scores, quantized_weighted_sum
from veloxquant_mlx.errors import QuantizerConfigError

SIDE_DTYPE = mx.float16  # scales, zeros and residual magnitudes
MIN_HEAD_DIM = 32  # the smallest group mx.quantize accepts


class TurboQuantRVQCache(CompressedKVCache):
    method = "turboquant_rvq"
    # Tokens encoded together: amortizes the per-encode work over decode steps.
    encode_block = 64
    # Recent tokens kept exact: 64 fp16 tokens cost 0.25 bits per element at 4096 tokens.
    exact_window = 64
    max_group_size = 64
    # The first tokens of the sequence (the attention sink) are read back exactly: their
    # codes stay in the store and a float32 correction (exact - decoded) per token is added to
    # their score column and to the weighted values. 0 turns it off.
    exact_sink_tokens = 1

    def _setup(self) -> None:
        total = self.config.bits_for_layer(self.layer_index, self.n_layers)
        self.key_bits = self.config.key_bits or total
        self.value_bits = self.config.value_bits or total
        for label, b in (("key_bits", self.key_bits), ("value_bits", self.value_bits)):
            if b not in (1, 2, 3, 4):
                raise QuantizerConfigError(
                    f"TurboQuantRVQCache (layer {self.layer_index}): {label}={b!r} is invalid: "
                    "allowed is 1..4 total bits per coordinate"
                )
        if not hasattr(self, "key_mean"):
            self.key_mean = None
        if not hasattr(self, "sink_deltas"):
            self.sink_deltas = None  # (keys, values) float32 (B, H, sink tokens, d): exact - decoded
        self._signs = None
        if self.head_dim:
            self._make_signs()

    @property
    def block_size(self) -> int:
        return self.encode_block

    @property
    def residual_length(self) -> int:
        return self.exact_window

    @staticmethod
    def stage_bits(total: int) -> tuple[int, int]:
        """(stage-1 bits, residual bits) for `total` bits per coordinate."""
        return total - 1, 1

    def _group(self, dim: int) -> int:
        return min(self.max_group_size, dim)

    def _check_shape(self, head_dim: int, value_dim: int) -> None:
        for label, d in (("head_dim", head_dim), ("value head_dim", value_dim)):
            if not is_power_of_two(d) or d < MIN_HEAD_DIM:
                raise QuantizerConfigError(
                    f"TurboQuantRVQCache (layer {self.layer_index}): {label}={d} is invalid: "
                    f"allowed is a power of 2 >= {MIN_HEAD_DIM} (the Hadamard rotation and "
                    "mx.quantize groups need it)"
                )

    def _make_signs(self) -> None:
        seed = self.config.seed
        # Streams 2i and 2i+1: different rotations per layer and for keys and values.
        self._signs = (
            random_signs(seed, 2 * self.layer_index, self.head_dim),
            random_signs(seed, 2 * self.layer_index + 1, self.value_dim),
        )

    def _parts(self):
        """(prefix, dim, total bits) for keys and values."""
        return (("k", self.head_dim, self.key_bits), ("v", self.value_dim, self.value_bits))

    def _stages(self, total: int) -> list[tuple[int, int]]:
        """(stage number, bits) of the stages that exist for `total` bits."""
        return [(i + 1, b) for i, b in enumerate(self.stage_bits(total)) if b]

    def _store_layout(self) -> list[StoreArray]:
        layout = []
        for p, dim, total in self._parts():
            for i, b in self._stages(total):
                layout.append(StoreArray(f"{p}_codes{i}", 2, 1, mx.uint32, (-1, dim * b // 32)))
                if b == 1:  # sign stage: one magnitude per vector
                    layout.append(StoreArray(f"{p}_scale{i}", 2, 1, SIDE_DTYPE, (-1, 1)))
                else:  # uniform stage: scale and zero per group
                    g = self._group(dim)
                    layout.append(StoreArray(f"{p}_scales{i}", 2, 1, SIDE_DTYPE, (-1, dim // g)))
                    layout.append(StoreArray(f"{p}_zeros{i}", 2, 1, SIDE_DTYPE, (-1, dim // g)))
        return layout

    # ---- encode / decode ----------------------------------------------------------------------
    def _encode(self, keys: mx.array, values: mx.array) -> dict[str, mx.array]:
        if self._signs is None:
            self._make_signs()
        if self.key_mean is None:
            self.key_mean = mx.mean(keys.astype(mx.float32), axis=2, keepdims=True).astype(keys.dtype)
        key_stages, value_stages = tuple(self._stages(self.key_bits)), tuple(self._stages(self.value_bits))
        names = stage_names("k", key_stages) + stage_names("v", value_stages)
        args = (key_stages, self._group(self.head_dim), value_stages, self._group(self.value_dim))
        if _encoder_fusion_is_exact(self.head_dim, self.value_dim):
            encode = _compiled_encoder(*args, _backend())
        else:
            encode = _encoder_function(*args)
        out = dict(zip(names, encode(keys, self.key_mean, self._signs[0], values, self._signs[1])))
        sink = min(self.exact_sink_tokens, keys.shape[2])
        if self.n_compressed == 0 and sink > 0:
            # This block starts the sequence: keep what its first tokens' codes miss.
            k_hat, v_hat = self._reconstruct(out, sink)
            self.sink_deltas = (
                keys[:, :, :sink].astype(mx.float32) - k_hat,
                values[:, :, :sink].astype(mx.float32) - v_hat,
            )
        return out

    def _encode_part(self, p: str, y: mx.array, total: int) -> dict[str, mx.array]:
        """The stages of rotated vectors y (uncompiled; `_encode` runs the same ops compiled)."""
        stages = self._stages(total)
        return dict(zip(stage_names(p, stages), encode_rotated(y, stages, self._group(y.shape[-1]))))

    def _stage_values(self, p: str, i: int, b: int, dim: int, store=None, n=None,
                      start: int = 0) -> mx.array:
        """One stage read back in float32 (rotated domain), over tokens [start, n) (n None: to
        the end); see `stage_values`."""
        store = self.store if store is None else store
        cut = (lambda a: a) if n is None and start == 0 else (lambda a: a[:, :, start:n])
        arrays = [cut(store[name]) for name in stage_names(p, [(i, b)])]
        return stage_values(b, self._group(dim), arrays)

    def _decode_part(self, p: str, dim: int, total: int, n: int, store=None, start: int = 0) -> mx.array:
        y = None
        for i, b in self._stages(total):
            part = self._stage_values(p, i, b, dim, store=store, n=n, start=start)
            y = part if y is None else y + part
        return y

    def _reconstruct(self, store, n: int, start: int = 0) -> tuple[mx.array, mx.array]:
        """Tokens [start, n) of `store` decoded to float32 K, V (no sink correction)."""
        return self._reconstruct_keys(store, n, start), self._reconstruct_values(store, n, start)

    def _reconstruct_keys(self, store, n: int, start: int = 0) -> mx.array:
        k = unrotate(self._decode_part("k", self.head_dim, self.key_bits, n, store, start), self._signs[0])
        return k + self.key_mean.astype(mx.float32)

    def _reconstruct_values(self, store, n: int, start: int = 0) -> mx.array:
        y = self._decode_part("v", self.value_dim, self.value_bits, n, store, start)
        return unrotate(y, self._signs[1])

    def _with_sink(self, x: mx.array, which: int, start: int) -> mx.array:
        """Decoded tokens [start, start + len) of keys (which=0) or values (1) with the exact
        sink's correction added to the sink tokens among them."""
        if self.sink_deltas is None:
            return x
        delta = self.sink_deltas[which]
        m = min(delta.shape[2], start + x.shape[2]) - start
        if m <= 0:
            return x
        return mx.concatenate([x[:, :, :m] + delta[:, :, start : start + m], x[:, :, m:]], axis=2)

    def _decode(self) -> tuple[mx.array, mx.array]:
        return self._decode_range(0, self.n_compressed)

    def _decode_range(self, start: int, stop: int, part: str = "kv"):
        """Compressed tokens [start, stop) decoded to the cache dtype: (K, V), or only K / V for
        part "k" / "v". Every op acts per token, so any split of the history decodes to the
        same values as one piece."""
        out = []
        if "k" in part:
            k = self._with_sink(self._reconstruct_keys(self.store, stop, start), 0, start)
            out.append(k.astype(self.dtype))
        if "v" in part:
            v = self._with_sink(self._reconstruct_values(self.store, stop, start), 1, start)
            out.append(v.astype(self.dtype))
        return tuple(out) if len(out) > 1 else out[0]

    # Bytes of one float32 (B, H, tokens, d) piece of history a prefill decodes at a time.
    prefill_decode_bytes = 16 << 20

    def _prefill_keys_values(self, queries: mx.array) -> tuple[mx.array, mx.array]:
        """The history decoded + the exact window, in the queries' dtype, built so that the
        only full-history array is the result itself (see "Memory of a prefill chunk" in the
        module docstring).

        1. The queries (and so the model up to this layer) are evaluated first. Otherwise each
           layer's decode, which reads only the already evaluated store, would be computed while
           the model's graph is still being built: every layer's decoded K/V would be held at
           once before any layer's attention ran (measured: a 4-layer 16K prefill peaked at
           0.434 GiB over its start without this step, 0.298 with it; fp16's cache 0.412).
        2. The result is allocated once in the queries' dtype and filled piece by piece
           (`prefill_decode_bytes` of float32 per piece; keys, then values), each piece
           evaluated before the next is made, so the float32 intermediates of the decode
           (stage values, their sum, the unrotation, the key mean, the sink correction) exist
           for one piece only and no concatenation with the window copies the result again.
        On MLX's CUDA backend (kernels on, shapes turboquant_prefill_kernel.supports takes)
        neither step runs: one kernel launch writes the whole result in the queries' dtype
        (no float32 history at all, bit for bit these values under the CPU emulation), its
        inputs ordered after the queries by mx.depends instead of a host sync (session 6: the
        ~9 syncs per layer and chunk here were the suspects of the 2.43x prefill on the H200).
        """
        if not self.n_compressed:
            return super()._prefill_keys_values(queries)
        # On CUDA one kernel writes the whole K/V in the queries' dtype, ordered after the
        # queries without a host sync (cache/turboquant_prefill_kernel.py); elsewhere the pieces.
        fused = turboquant_prefill_kernel.prefill_step(self, queries)
        if fused is not None:
            return fused
        dtype = queries.dtype
        self._order_after_queries(queries)  # the base class's prefill_eval_queries
        n, w = self.n_compressed, self._window_length()
        B, H = self.batch_size, self.n_kv_heads
        per_token = B * H * max(self.head_dim, self.value_dim) * 4
        piece = prefill_pieces.piece_tokens(self.prefill_decode_bytes, per_token, self.block_size)
        out = []
        parts = ((self.head_dim, self.window_keys), (self.value_dim, self.window_values))
        previous = None
        for which, (dim, window_part) in enumerate(parts):
            full = mx.zeros((B, H, n + w, dim), dtype)
            for start in range(0, n, piece):
                stop = min(n, start + piece)
                previous = self._compiled_decode_range(start, stop, which, after=previous).astype(dtype)
                full[:, :, start:stop] = previous
                prefill_pieces.settle(full)
            if w:
                full[:, :, n:] = window_part.astype(dtype)
            out.append(full)
        return out[0], out[1]

    def _compiled_decode_range(self, start: int, stop: int, which: int, after=None) -> mx.array:
        """`_decode_range(start, stop, "kv"[which])` through one compiled function (the same
        ops, bit for bit; tests/cache/test_turboquant_rvq_encoder_identity.py). Only the prefill
        uses it: its pieces have one or two lengths per chunk, while `_decode` (the lazily
        decoded K/V of every update_and_fetch) sees a new length every block, and mx.compile
        traces again per input shape. `after`: the previous piece's output, which this piece's
        inputs wait for (prefill_pieces.chained)."""
        p, dim, total = self._parts()[which]
        stages = tuple(self._stages(total))
        arrays = prefill_pieces.chained([a[:, :, start:stop] for a in self._stage_arrays(p, stages)], after)
        extra = [self.key_mean] if which == 0 else []
        sink = 0
        if self.sink_deltas is not None:
            delta = self.sink_deltas[which]
            sink = max(0, min(delta.shape[2], stop) - start)
            if sink:
                extra.append(delta[:, :, start : start + sink])
        decode = _compiled_decoder(
            stages, self._group(dim), which == 0, sink, self.dtype, _backend()
        )
        return decode(self._signs[which], arrays, extra)

    def _stage_arrays(self, p: str, stages) -> list[mx.array]:
        """The store's arrays of part p's stages, in `stage_names` order."""
        return [self.store[name] for name in stage_names(p, stages)]

    # ---- attention over the compressed form ---------------------------------------------------
    def _products(self, p: str, x: mx.array, dim: int, total: int, transpose: bool) -> mx.array:
        """x times the rotated-domain codes of every stage, summed: uniform stages through the
        affine products, the sign stage through cache/sign_plane.py (no 1-bit kernel: CUDA has
        none). On the CPU each of them reads the codes as planes for float32 BLAS products
        (cache/unpacked_products.py; numbers in its docstring)."""
        dtype = compute_dtype(x.dtype)
        xc = x.astype(dtype)
        out = None
        for i, b in self._stages(total):
            codes = self.store[f"{p}_codes{i}"]
            if b == 1:
                mags = self.store[f"{p}_scale{i}"]
                product = sign_scores if transpose else sign_weighted_sum
                part = product(xc, codes, mags)
            else:
                scales = self.store[f"{p}_scales{i}"].astype(dtype)
                zeros = self.store[f"{p}_zeros{i}"].astype(dtype)
                # Long token axes of the weighted sum split into chunks off the CPU (the H200
                # runs one long reduction slowly).
                product = quantized_scores if transpose else quantized_weighted_sum
                part = product(xc, codes, scales, zeros, group_size=self._group(dim), bits=b)
            out = part if out is None else out + part
        return out.astype(x.dtype)

    def _scores(self, q: mx.array) -> mx.array:
        q_rot = rotate(q, self._signs[0])
        scores = self._products("k", q_rot, self.head_dim, self.key_bits, transpose=True)
        # The centered-out key mean: the same q . mean for every compressed column of a row.
        scores = scores + q @ self.key_mean.astype(q.dtype).swapaxes(-1, -2)
        if self.sink_deltas is None:
            return scores
        dk = self.sink_deltas[0]
        s = dk.shape[2]
        exact = scores[..., :s] + (q.astype(mx.float32) @ dk.swapaxes(-1, -2)).astype(scores.dtype)
        return mx.concatenate([exact, scores[..., s:]], axis=-1)

    def _fused_decode(self, queries: mx.array, scale: float):
        # On MLX's CUDA backend one decode step through a kernel reading the codes once
        # (cache/fused_decode_rotated.py); None elsewhere (the portable path above).
        return fused_decode_rotated.decode_step(self, queries, scale)

    def _weighted_values(self, p: mx.array) -> mx.array:
        out_rot = self._products("v", p, self.value_dim, self.value_bits, transpose=False)
        out = unrotate(out_rot, self._signs[1])
        if self.sink_deltas is None:
            return out
        dv = self.sink_deltas[1]
        return out + (p[..., : dv.shape[2]].astype(mx.float32) @ dv).astype(out.dtype)

    # ---- accounting and state -----------------------------------------------------------------
    def _part_bits(self, dim: int, total: int) -> float:
        bits = 0.0
        for _, b in self._stages(total):
            # A sign stage: one fp16 magnitude per vector; a uniform one: fp16 scale + zero per group.
            bits += b + (16 / dim if b == 1 else 2 * 16 / self._group(dim))
        return bits

    def bits_per_element(self) -> float:
        """Stored bits per cached K/V element of the compressed history (keys and values
        averaged, weighted by their head dims): codes + side data. The exact window and the
        key mean and the sink corrections (d values per head each) are not included."""
        d_k = self.head_dim or 64
        d_v = self.value_dim or d_k
        bits_k = self._part_bits(d_k, self.key_bits)
        bits_v = self._part_bits(d_v, self.value_bits)
        return (bits_k * d_k + bits_v * d_v) / (d_k + d_v)

    @property
    def nbytes(self) -> int:
        extra = 0 if self.key_mean is None else self.key_mean.nbytes
        if self.sink_deltas is not None:
            extra += sum(d.nbytes for d in self.sink_deltas)
        return super().nbytes + extra

    @property
    def state(self):
        deltas = self.sink_deltas or (None, None)
        return (*CompressedKVCache.state.fget(self), self.key_mean, *deltas)

    @state.setter
    def state(self, v):
        # (meta, window_keys, window_values, *arrays, key_mean, sink_key_delta, sink_value_delta);
        # states written before the sink correction end at key_mean.
        base, extra = self._split_state(
            v, (1, 3), "(meta, window_keys, window_values, *arrays, key_mean, sink_key_delta, "
            "sink_value_delta), or ending at key_mean (states written before the sink correction)")
        self.key_mean = extra[0]
        deltas = extra[1:]
        self.sink_deltas = deltas if len(deltas) == 2 and deltas[0] is not None else None
        CompressedKVCache.state.fset(self, base)


# ---- the encoder's and the prefill decode's pure parts, through mx.compile --------------------
# One compiled function per setting (mx.compile traces again per input shape). What fuses is
# the elementwise work between mx.quantize / mx.dequantize / the Hadamard transform / the
# reductions: the centering, the sign multiply, the side data's casts, the residual, the sign
# test and the shifts of the sign packing, |r|, and in the decode the stage sum, the sign
# multiply, the key mean, the sink correction and the cast. Every one of those non-fusable ops
# is the same op on the same values as uncompiled, so the stored bits and the decoded K/V are
# identical (tests/cache/test_turboquant_rvq_encoder_identity.py against the frozen encoder of
# main 714de0c, tests/cache/turboquant_rvq_reference.py).
# Why this holds on the GPU too, where nvrtc may contract a fused a * b + c into one FMA
# (s4-encspeed's finding): in these graphs no rounded product feeds an add or subtract inside
# one fused kernel except (H y) * s + mean in the decode, where s = +-1 makes the product exact,
# so the FMA rounds as the two ops did. mx.quantize / mx.dequantize (the affine kernels' a * w +
# b) are single primitives on the GPU, not fused; on the CPU MLX builds them from elementwise
# ops, which do fuse, but its fused CPU kernels are built for baseline x86-64 (no FMA). With the
# matmul form of the Hadamard transform (a backend without mx.hadamard_transform) the decode's
# ((y H) * scale) * s + mean still contracts exactly (s = +-1); the encoder's (x H) * scale
# feeds mx.quantize and the residual's subtract, and should the fusion recompute it inside the
# subtract's kernel, (x H) * scale - stage1 could become an FMA: there the encoder runs
# uncompiled unless d^-1/2 is a power of two (`_encoder_fusion_is_exact`).


def stage_names(p: str, stages) -> list[str]:
    """Store names of part p's stages, in the order encode_rotated returns their arrays."""
    names = []
    for i, b in stages:
        side = [f"{p}_scale{i}"] if b == 1 else [f"{p}_scales{i}", f"{p}_zeros{i}"]
        names += [f"{p}_codes{i}", *side]
    return names


def stage_values(b: int, group: int, arrays) -> mx.array:
    """One stage read back in float32 (rotated domain) from its arrays (codes, magnitudes) or
    (codes, scales, zeros). A sign stage is a * (2 bits - 1), read at a supported width
    (cache/sign_plane.py: MLX's CUDA backend has no 1-bit dequantize)."""
    if b == 1:
        return sign_values(*arrays)
    codes, scales, zeros = arrays
    # float32 side data: dequantize returns the scales' dtype, and fp16 would round.
    return mx.dequantize(codes, scales.astype(mx.float32), zeros.astype(mx.float32), group_size=group, bits=b)


def encode_rotated(y: mx.array, stages, group: int) -> list[mx.array]:
    """Rotated float32 vectors y (..., d) -> every stage's arrays, in stage_names order."""
    out = []
    residual = y
    for i, b in stages:
        if b == 1:
            # Sign code with the least-squares magnitude mean |r| (1-bit min/max affine
            # codes would put both levels at the extremes).
            arrays = [
                pack_codes(residual >= 0, 1),
                mx.mean(mx.abs(residual), axis=-1, keepdims=True).astype(SIDE_DTYPE),
            ]
        else:
            codes, scales, zeros = mx.quantize(residual, group_size=group, bits=b)
            arrays = [codes, scales.astype(SIDE_DTYPE), zeros.astype(SIDE_DTYPE)]
        out += arrays
        if (i, b) != stages[-1]:
            # What the next stage quantizes: the residual against what will really be read
            # back (fp16 side data).
            residual = residual - stage_values(b, group, arrays)
    return out


def decode_rotated(arrays, stages, group: int) -> mx.array:
    """The stages' arrays (stage_names order) -> their sum, float32 in the rotated domain."""
    y, k = None, 0
    for _, b in stages:
        n = 2 if b == 1 else 3
        part = stage_values(b, group, arrays[k : k + n])
        k += n
        y = part if y is None else y + part
    return y


def _backend() -> tuple[str, bool]:
    """Keys the compiled functions' caches: the device and whether the Hadamard transform is
    MLX's primitive there or the matmul (the traced graph differs). The probe evaluates, so it
    runs here, before any trace."""
    return str(mx.default_device()), fast_transform_available()


def _encoder_fusion_is_exact(*dims: int) -> bool:
    """Whether the compiled encoder stores what the uncompiled one does. It does wherever the
    rotation is mx.hadamard_transform (a single primitive), and on the CPU (no FMA in MLX's
    fused CPU kernels). A backend without that transform rotates by (x @ H) * d^-1/2, whose
    product could be contracted with the residual's subtract, y - stage1(y), into one FMA if
    the fusion recomputed it there; that FMA is exact only where d^-1/2 is a power of two (d =
    4^k). The probe evaluates, so it runs here, before any trace."""
    if fast_transform_available() or mx.default_device() == mx.cpu:
        return True
    return all(d & 0x55555555 and is_power_of_two(d) for d in dims)


@lru_cache(maxsize=None)
def _encoder_function(key_stages, key_group: int, value_stages, value_group: int):
    """(keys, key mean, key signs, values, value signs) -> the key stages' arrays then the value
    stages' (stage_names order)."""

    def encode(keys, key_mean, key_signs, values, value_signs):
        k = keys.astype(mx.float32) - key_mean.astype(mx.float32)
        return (
            *encode_rotated(rotate(k, key_signs), key_stages, key_group),
            *encode_rotated(rotate(values.astype(mx.float32), value_signs), value_stages, value_group),
        )

    return encode


@lru_cache(maxsize=None)
def _compiled_encoder(key_stages, key_group: int, value_stages, value_group: int, backend: tuple):
    """`_encoder_function` through mx.compile. `backend` only keys the cache: the Hadamard
    transform's form depends on the backend (`_backend`)."""
    return mx.compile(_encoder_function(key_stages, key_group, value_stages, value_group))


@lru_cache(maxsize=None)
def _compiled_decoder(stages, group: int, centered: bool, sink: int, dtype: mx.Dtype, backend: tuple):
    """(signs, stage arrays of some tokens, [key mean if centered] + [sink deltas of the first
    `sink` of those tokens if sink]) -> those tokens decoded to `dtype`: what
    TurboQuantRVQCache._decode_range computes."""

    def decode(signs, arrays, extra):
        x = unrotate(decode_rotated(arrays, stages, group), signs)
        if centered:
            x = x + extra[0].astype(mx.float32)
        if sink:
            x = mx.concatenate([x[:, :, :sink] + extra[-1], x[:, :, sink:]], axis=2)
        return x.astype(dtype)

    return mx.compile(decode)
