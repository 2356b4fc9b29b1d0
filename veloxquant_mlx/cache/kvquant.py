"""KVQuant: per-channel keys, per-token values, non-uniform codebooks, dense-and-sparse outliers.

Hooper et al. 2024, "KVQuant: Towards 10 Million Context Length LLM Inference with KV Cache
Quantization", arXiv 2401.18079. What this cache stores per block of G = kvquant_group_size
tokens and KV head:
  keys   : per-channel normalization (zero = mid-range, scale = half-range of each channel over
           the G tokens, outliers excluded), codes of the normalized values, packed in uint32
           words over the whole block (G * head_dim codes, so 3-bit codes waste < 1% padding);
  values : per-token normalization (mid / half-range over head_dim), codes packed the same way;
  codes  : indices into a non-uniform codebook of 2**kvquant_bits levels ("nuqX"), one for keys
           and one for values per KV head, fitted by Lloyd / k-means on the first block encoded;
  sparse : round(kvquant_outlier_fraction * G * head_dim) entries per block, kept exactly
           (uint16 position + value in the cache dtype), removed before normalization;
  sink   : the first token's keys and values exactly (the paper's attention-sink handling).
Nothing else is held: no recent fp16 window (residual_length 0); the base's window only holds the
< G tokens of a block not yet full.

Attention reads this form (see `_scores`, `_weighted_values` and kvquant_attention.py): codes
are looked up in the codebook chunk by chunk of at most `decode_chunk_tokens` tokens, the
chunk's outliers and the sink written into those levels, the key scales folded into the query
and the value scales into the probabilities; the transient is one chunk of codebook levels,
K and V are never materialized. On MLX's CUDA backend a decode step instead runs one
partials kernel over the packed codes (fused_decode_codebook.py) and fused_decode's merge.

Encoding runs through mx.compile (`_compiled_normalize`, `_compiled_codes`, and the codebook
fit in nonuniform_codebook.py): the elementwise ops between its reductions, argpartitions and
scatters fuse, which stores the same bits as the uncompiled ops (tests/cache/
test_encoder_identity.py) in fewer passes: one layer of 8 KV heads x 128, a 2048-token chunk,
on the CPU 1.29-1.47x faster (results/encoder_speed_cpu_s4.json; not yet measured on a GPU).

Prefill (session 5). On the H200 (8B-shaped llama, 8 layers, bf16, 2048-token chunks) kvquant's
32K prefill took 1.68 s warm against fp16's 0.41 (4.1x; results/gpu_speed_h200_s4.json), its 128K
one 30.1 s against 5.88, and its untimed 2K warm-up 69.7 s against kivi's 5.2
(results/gpu_speed_h200_s5_128k.json). A prefill chunk decodes the layer's whole history for
mx.fast attention and then encodes the chunk. Measured here (one layer, 8 kv heads x 128,
2048-token chunks up to 16K, CPU under load 60+; `python -m tests.cache.bench_kvquant_prefill`):
  - host syncs: one per layer and chunk, the base's prefill_eval_queries (the CUDA kernel
    path orders by mx.depends instead: none); none in this method's code (no .item(),
    .tolist() or numpy); the encoder: none;
  - traces: the encoder's compiled functions see one shape per chunk (64 blocks), traced on
    the first chunk and again only for mlx-lm's last chunk, one token short (63 blocks); the
    history decode was eager (no traces) through `_decode`: per 1024-token chunk (4096 off the
    CPU) ~12 ops, then a float32 concatenation of the pieces, a cast of the whole history and
    a concatenation with the window: 386 non-view graph nodes at 14K history (bf16);
  - first use: a 2K prompt built 17 distinct fused kernels (each a JIT compile on a GPU, ~s
    cold), kivi's 4; 4 of them only the codebook fit's (work done once per layer; its other 2,
    nearest_level's, the codes function builds as well: kernels are named by their ops, not
    shapes, so those are shared).
`_prefill_keys_values` now, on MLX's CUDA backend (kernels on, fused_decode.kernels_enabled),
decodes each part's whole history with one kernel (kvquant_prefill_kernel.py) straight into the
result in the queries' dtype, the exact window copied after it by the same launch: one launch per
part and prompt chunk whatever the history, no float32 array, one compile for every length. Elsewhere (the CPU,
or VELOXQUANT_CUDA_KERNELS=0) it writes fixed-size pieces (`_prefill_pieces`: every piece the
same number of blocks, the last moved back to overlap its neighbour, so the shapes stop
changing once the history holds one piece) into one result allocated in the queries' dtype: no
float32 history, no concatenation. On the CPU each piece is one compiled function (exact
there); on another GPU backend eager by default, or compiled with the product kept apart
(`prefill_compiled_off_cpu`; an FMA would change bits otherwise, see `_prefill_piece_mode`).
The codebook's pair table is built once per codebook, and the codebook fit runs eagerly off
the CPU (nonuniform_codebook.fit_codebook). Decoded values bit-identical to the base path
(tests/cache/test_kvquant_prefill.py: bf16 and float32, with and without outliers, all three
piece modes; test_kvquant_prefill_kernel_emulated.py: the kernel under the CPU emulation, bf16,
fp16 and float32 caches, 2-4 bits, with and without outliers, other queries dtypes).
Measured here, the pieces' history decode per chunk (two runs of 3 fills, each run's median
over the repeat fills shown; same load): at 8K history bf16 308/303 -> 250/232 ms, float32 513/796 ->
216/354 ms; at 14K bf16 582/1427 -> 244/405 ms, float32 693/1155 -> 393/643 ms; graph nodes
386 -> 260 (bf16), 298 -> 202 (float32); peak memory of one 16K bf16 history decode over its
start 394 -> 171 MiB (the result itself 72 MiB). The first history chunks trace the pieces
(4 traces: sink piece and the others, keys and values), none after
(tests/cache/test_kvquant_prefill_warmup.py). First-use fused kernels of a 2K prompt with the
GPU's choices (`--warmup --as-gpu`): 17 -> 13 (the prefill kernel adds two
mx.fast.cuda_kernel compiles, keys and values having different templates). Not yet run on a
GPU (no device time this session): `pytest
tests/cache/test_kvquant_prefill_kernel_emulated.py` (its CUDA identity test), then `python -m
veloxquant_mlx.bench.kernel_probe --parts prefill --methods kvquant` and `python -m
veloxquant_mlx.bench.gpu_speed --methods fp16,kvquant --contexts 32768 --repeats 2`, and with
VELOXQUANT_CUDA_KERNELS=0 the eager pieces for comparison.

Deviations from the paper (all because a cache sees no calibration data and post-RoPE keys):
  - Keys are quantized after RoPE: mlx-lm hands the cache rotated keys and the attention
    receives rotated queries, so pre-RoPE quantization would need the model's RoPE inside the
    cache (a different contract). The paper reports pre-RoPE helps most at 2-3 bits.
  - Key scales are per channel per group of G tokens, computed online, instead of one per
    channel calibrated offline; value scales are per token online, as in the paper.
  - The nuq codebook is fitted online on the first encoded block (normally the prefill), per KV
    head, with plain (unweighted) k-means; the paper fits one per layer offline on calibration
    data with Fisher-information (sensitivity) weights. Later blocks reuse it; trimming the
    whole history refits it.
  - Outliers: a fixed count per block, ranked by distance from their vector (per channel for
    keys, per token for values) in units of that vector's std, instead of per-vector thresholds
    with a variable count stored as CSR/CSC. Dense-part holes are filled with the vector mean.
  - No Q-Norm (the paper's centroid shift for 2-bit); the first-token sink is kept.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from veloxquant_mlx.cache import (
    fused_decode_codebook,
    kvquant_encode_kernel,
    kvquant_prefill_kernel,
    outlier_select_kernel,
)
from veloxquant_mlx.cache.base import CompressedKVCache, StoreArray
from veloxquant_mlx.cache.kvquant_attention import (
    chunks,
    decode_key_blocks,
    decode_value_blocks,
    scores_function,
    values_function,
)
from veloxquant_mlx.cache.nonuniform_codebook import fit_codebook, lookup_table, nearest_level
from veloxquant_mlx.cache.packing import pack_codes, packed_length
from veloxquant_mlx.cache.sink import with_sink_placeholder
from veloxquant_mlx.cache.sparse_outliers import (
    gather_entries,
    outlier_count,
    outlier_ranking,
    outlier_scores,
    replace_with_vector_mean,
    select_outliers,
)
from veloxquant_mlx.errors import QuantizerConfigError

MIN_HEAD_DIM = 8
CPU_CHUNK_TOKENS = 1024
# Off the CPU (Metal; CUDA with VELOXQUANT_CUDA_KERNELS=0) a chunk costs launches, not cache
# misses: the portable readers' graph per layer and step at 16K tokens of history (8 KV heads x
# 128, bf16; `python -m veloxquant_mlx.bench.step_census --stand-ins off --methods
# fp16,kvquant-chunk1024,kvquant-chunk4096,kvquant-chunk16384 --history 16384 --chunk 2048
# --layers 2 --steps 16`, results/step_census_cpu_s38_kvquant_chunks.json) holds 386 ops / 201
# launches with 4096-token chunks (the setting until session 38) and 197 / 102 with 16384 (two
# chunks per part: the history and its slack), where fp16's holds 16 / 6; every chunk more adds
# ~25 launches per part. Its float32 transient, one chunk's codebook levels per
# part: 16384 x head_dim x 4 bytes per KV head (64 MiB at 8 x 128). Not yet timed on Metal or
# with the CUDA kernels off (gpu_speed's `kvquant-chunk4096` is the A/B).
GPU_CHUNK_TOKENS = 16384
# Smallest stored scale (the smallest normal fp16): keeps (outlier - zero) / scale finite.
MIN_SCALE = 2.0**-14


class KVQuantCache(CompressedKVCache):
    method = "kvquant"
    # Tokens whose codes are looked up at once in attention: bounds the per-step transient to
    # chunk * head_dim floats per head whatever the context length. None: CPU_CHUNK_TOKENS on
    # the CPU, where a chunk that stays in cache between the lookup and its product was
    # ~15-25% faster than 4096 (one layer, 8 KV heads x 128, 8K tokens: medians 91 / 92 ms
    # for 512 / 1024 against 123 ms for 4096, 2 shared cores under load 8), else
    # GPU_CHUNK_TOKENS (fewer, larger kernels, above). An int overrides.
    decode_chunk_tokens: int | None = None
    # Where the prefill's history is decoded in pieces off the CPU (a GPU without our CUDA
    # kernel: VELOXQUANT_CUDA_KERNELS=0, or another backend) they run as eager ops (no fused
    # kernel to JIT on first use); True: through mx.compile with the product kept apart (same
    # bits). See `_prefill_piece_mode`; not yet measured on a GPU.
    prefill_compiled_off_cpu: bool = False
    # Tokens of history one prefill piece decodes (rounded down to whole blocks; the pieces'
    # path only, not the CUDA kernel's, which decodes the whole history at once). None: the
    # attention's chunk (`_chunk_blocks`: 1024 on the CPU, 16384 elsewhere). Larger pieces mean
    # fewer launches per prompt chunk on a GPU (~14 eager ops per piece) and a larger float32
    # transient (one piece's). On the CPU (16K history, 8 x 128, 5 runs under load ~60)
    # medians float32 1143 / 912 / 1168 ms, bf16 861 / 1111 / 1190 ms for 1024 / 4096 /
    # 16384: no clear winner. An int overrides (e.g. 16384 for a GPU session to try).
    prefill_piece_tokens: int | None = None

    def _setup(self) -> None:
        # Not named `bits`: mlx-lm routes any cache with a `bits` attribute to its own
        # quantized attention, which would misread our decoded K/V when unpatched.
        self.code_bits = self.config.kvquant_bits
        self.group_size = self.config.kvquant_group_size
        self.outlier_fraction = self.config.kvquant_outlier_fraction
        if self.code_bits not in (2, 3, 4):
            raise QuantizerConfigError(
                f"KVQuantCache: kvquant_bits={self.code_bits!r} is invalid: allowed is 2, 3 or 4"
            )

    @property
    def block_size(self) -> int:
        return self.group_size

    @property
    def residual_length(self) -> int:
        return 0

    def _check_shape(self, head_dim: int, value_dim: int) -> None:
        for label, dim in (("head_dim", head_dim), ("value head_dim", value_dim)):
            if dim < MIN_HEAD_DIM or dim * self.group_size > 1 << 16:
                raise QuantizerConfigError(
                    f"KVQuantCache (layer {self.layer_index}): {label}={dim} is invalid for "
                    f"kvquant_group_size={self.group_size}: allowed is {MIN_HEAD_DIM} <= {label} "
                    f"<= {(1 << 16) // self.group_size} (outlier positions are uint16 per block)"
                )

    # ---- layout -------------------------------------------------------------------------------
    def _outliers(self, dim: int) -> int:
        return outlier_count(self.outlier_fraction, self.group_size, dim)

    def _store_layout(self) -> list[StoreArray]:
        G, D, Dv, dt = self.group_size, self.head_dim, self.value_dim, self.dtype
        per_block = [
            ("key_codes", mx.uint32, packed_length(G * D, self.code_bits)),
            ("key_scale", dt, D),
            ("key_zero", dt, D),
            ("value_codes", mx.uint32, packed_length(G * Dv, self.code_bits)),
        ]
        for prefix, dim in (("key", D), ("value", Dv)):
            if self._outliers(dim):
                per_block.append((f"{prefix}_outlier_position", mx.uint16, self._outliers(dim)))
                per_block.append((f"{prefix}_outlier_value", dt, self._outliers(dim)))
        layout = [StoreArray(n, axis=2, tokens_per_index=G, dtype=t, trailing=(-1, w)) for n, t, w in per_block]
        layout += [
            StoreArray("value_scale", axis=2, tokens_per_index=1, dtype=dt, trailing=(-1,)),
            StoreArray("value_zero", axis=2, tokens_per_index=1, dtype=dt, trailing=(-1,)),
        ]
        return layout

    def bits_per_element(self) -> float:
        """Stored bits per cached K/V element of the compressed history (sink and codebooks,
        a fixed few hundred bytes per layer, left out)."""
        G, D, Dv = self.group_size, self.head_dim or 128, self.value_dim or self.head_dim or 128
        side = 8 * (self.dtype.size if self.dtype is not None else 2)
        bits = 32 * (packed_length(G * D, self.code_bits) + packed_length(G * Dv, self.code_bits))
        bits += 2 * side * D  # key scale + zero per channel per block
        bits += 2 * side * G  # value scale + zero per token
        bits += (16 + side) * (self._outliers(D) + self._outliers(Dv))
        return bits / (G * (D + Dv))

    # ---- encoding -----------------------------------------------------------------------------
    def _encode(self, keys: mx.array, values: mx.array) -> dict[str, mx.array]:
        """Whole blocks of the window -> the store's arrays for them (module docstring). The
        first chunk (sink, codebook fit) runs the MLX ops, compiled where exact; a later one on
        MLX's CUDA backend with our kernels on `_kernel_encode` (18 launches per layer and
        chunk instead of 60 in bf16; tests/cache/bench_kvquant_encode.py), elsewhere the same
        ops."""
        B, H, n, _ = keys.shape
        G, nb = self.group_size, keys.shape[2] // self.group_size
        first = self.n_compressed == 0
        if first:
            # The attention sink: kept exactly, and kept out of its block's statistics (its
            # entries are often far larger than the rest) by copying token 1 over it.
            # A copy, not a slice: a slice is a view that would keep the whole prompt chunk's
            # K/V buffers alive for the cache's lifetime (measured: +3.1 MB per layer after a
            # 2047-token chunk of SmolLM2's shape, 6x the layer's compressed bytes).
            self.store["sink_keys"] = mx.contiguous(keys[:, :, :1])
            self.store["sink_values"] = mx.contiguous(values[:, :, :1])
            self._store_written()
            keys, values = with_sink_placeholder(keys, 1), with_sink_placeholder(values, 1)
        kb = keys.reshape(B, H, nb, G, self.head_dim)
        vb = values.reshape(B, H, nb, G, self.value_dim)
        if not first and self._encode_kernel_applies():
            return self._kernel_encode(kb, vb)
        out = {}
        for prefix, blocks, axis in (("key", kb, -2), ("value", vb, -1)):
            count = self._outliers(blocks.shape[-1])
            normalize = _normalize_function(count, axis, self.dtype)
            if _fusion_is_exact(blocks.shape[axis]):
                normalize = _compiled_normalize(count, axis, self.dtype)
            normalized, zero, scale, *sparse = normalize(blocks)
            if count:
                out[f"{prefix}_outlier_position"], out[f"{prefix}_outlier_value"] = sparse
            if first:
                self.store[f"{prefix}_codebook"] = fit_codebook(
                    normalized.reshape(B, H, -1), 1 << self.code_bits
                )
                self._store_written()
            out[f"{prefix}_codes"] = _compiled_codes(self.code_bits)(normalized, self.store[f"{prefix}_codebook"])
            if axis == -1:  # per-token side data is stored per token
                zero, scale = zero.reshape(B, H, nb * G), scale.reshape(B, H, nb * G)
            out[f"{prefix}_zero"], out[f"{prefix}_scale"] = zero, scale
        return out

    def _encode_kernel_applies(self) -> bool:
        """Whether a later chunk's encode runs through kvquant_encode_kernel.py (MLX's CUDA
        backend, kernels on, blocks small enough for its shared memory)."""
        G = self.group_size
        return (
            kvquant_encode_kernel.enabled()
            and kvquant_encode_kernel.fits(G, self.head_dim)
            and kvquant_encode_kernel.fits(G, self.value_dim)
        )

    def _kernel_encode(self, kb: mx.array, vb: mx.array) -> dict[str, mx.array]:
        """`_encode` of a later chunk on CUDA: the outlier selection and the sums of the kept
        entries stay MLX ops (their bits depend on MLX's reduction and argpartition orders),
        the rest is kvquant_encode_kernel.py's two kernels; the same stored bits, 9 launches
        per part instead of 30 in bf16 (8 / 29 in float32; kvquant_encode_kernel.py)."""
        B, H, nb, G, _ = kb.shape
        out = {}
        for prefix, blocks, axis in (("key", kb, -2), ("value", vb, -1)):
            count = self._outliers(blocks.shape[-1])
            ranking = kept = None
            if count:
                ranking = _outlier_ranking(blocks, count, axis)
                kept = kvquant_encode_kernel.masked_blocks(blocks, ranking, count).sum(axis=axis)
            codes, zero, scale, positions, exact = kvquant_encode_kernel.encode_blocks(
                blocks, self.store[f"{prefix}_codebook"], self.code_bits, axis == -2, MIN_SCALE, count, ranking, kept
            )
            if count:
                out[f"{prefix}_outlier_position"], out[f"{prefix}_outlier_value"] = positions, exact
            if axis == -1:  # per-token side data is stored per token
                zero, scale = zero.reshape(B, H, nb * G), scale.reshape(B, H, nb * G)
            out[f"{prefix}_codes"], out[f"{prefix}_zero"], out[f"{prefix}_scale"] = codes, zero, scale
        return out

    # ---- reading ------------------------------------------------------------------------------
    def _chunk_blocks(self) -> int:
        tokens = self.decode_chunk_tokens
        if tokens is None:
            tokens = CPU_CHUNK_TOKENS if mx.default_device() == mx.cpu else GPU_CHUNK_TOKENS
        return max(1, tokens // self.group_size)

    def _reader_args(self, prefix: str) -> list[mx.array]:
        """The arrays kvquant_attention's functions read for keys or values, over the capacity."""
        names = [f"{prefix}_codes", f"{prefix}_scale", f"{prefix}_zero", f"{prefix}_codebook", f"sink_{prefix}s"]
        if f"{prefix}_outlier_position" in self.store:
            names += [f"{prefix}_outlier_position", f"{prefix}_outlier_value"]
        return [self.store[n] for n in names]

    def _scores(self, q: mx.array) -> mx.array:
        outliers = "key_outlier_position" in self.store
        fn = scores_function(self.code_bits, self.group_size, self.head_dim, self._chunk_blocks(), outliers)
        return fn(q, *self._reader_args("key"))

    def _weighted_values(self, p: mx.array) -> mx.array:
        outliers = "value_outlier_position" in self.store
        fn = values_function(self.code_bits, self.group_size, self.value_dim, self._chunk_blocks(), outliers)
        return fn(p, *self._reader_args("value"))

    def _fused_decode(self, queries: mx.array, scale: float):
        # On CUDA: one partials kernel over the packed codes (fused_decode_codebook.py) and the
        # shared merge; the sink's placeholder token is skipped there and its exact K/V attended
        # with the window. Elsewhere (or a shape it refuses) None: the compiled chunked path.
        return fused_decode_codebook.decode_step(self, queries, scale)

    def _decode(self) -> tuple[mx.array, mx.array]:
        n_blocks = self.n_compressed // self.group_size
        out = []
        for prefix, dim, decode in (
            ("key", self.head_dim, decode_key_blocks),
            ("value", self.value_dim, decode_value_blocks),
        ):
            codes, scale, zero, codebook, sink, *sparse = self._reader_args(prefix)
            table = self._lookup_table(prefix, dim)
            parts = [
                decode(
                    codes, scale, zero, codebook, b0, b1, self.code_bits, self.group_size, dim,
                    sparse or None, sink if b0 == 0 else None, table,
                )
                for b0, b1 in chunks(n_blocks, self._chunk_blocks())
            ]
            x = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)
            out.append(x.astype(self.dtype))
        return out[0], out[1]

    def _lookup_table(self, prefix: str, dim: int) -> mx.array:
        """lookup_table of the stored codebook, kept while the codebook is the same array: the
        codebook is written once (first encode; a restored state or a trim to nothing brings
        a new array), so the few ops that build the pair table run once, not per read."""
        codebook = self.store[f"{prefix}_codebook"]
        tables = self.__dict__.setdefault("_tables", {})
        cached = tables.get(prefix)
        if cached is None or cached[0] is not codebook:
            cached = (codebook, lookup_table(codebook, self.code_bits, self.group_size * dim))
            tables[prefix] = cached
        return cached[1]

    def _prefill_pieces(self, n_blocks: int) -> tuple[int, list[int]]:
        """(blocks per piece, first block of each piece) covering [0, n_blocks) for the prefill
        decode: every piece has the same size, at most `prefill_piece_tokens`, the last one moved
        back to end at n_blocks (it overlaps its neighbour, whose blocks it decodes again to
        the same values: every op is per block). So once the history holds a whole piece the
        shapes no longer change from one prompt chunk to the next (one compiled trace, and on
        a GPU the same kernels), and no piece reads past the filled blocks."""
        per_piece = self._chunk_blocks()
        if self.prefill_piece_tokens is not None:
            per_piece = max(1, self.prefill_piece_tokens // self.group_size)
        piece = min(per_piece, n_blocks)
        starts = list(range(0, n_blocks - piece + 1, piece))
        if starts[-1] + piece < n_blocks:
            starts.append(n_blocks - piece)
        return piece, starts

    def _prefill_keys_values(self, queries: mx.array) -> tuple[mx.array, mx.array]:
        """The decoded history and the exact window in the queries' dtype for a prefill chunk's
        fused attention: the same values as the base class's `_full_keys_values()` path (the
        history decoded to float32, cast to the cache dtype, then to the queries'), built for
        speed and memory (see "Prefill" in the module docstring): the result is allocated once
        and written piece by piece, each piece cast straight to the queries' dtype, with no
        float32 history, no concatenation of pieces or with the window, and fixed-size pieces
        (`_prefill_pieces`) decoded through one compiled function where fusion is exact."""
        if not self.n_compressed:
            return super()._prefill_keys_values(queries)
        if kvquant_prefill_kernel.enabled():
            return self._kernel_keys_values(queries)
        self._order_after_queries(queries)  # the base class's prefill_eval_queries
        dtype, G = queries.dtype, self.group_size
        B, H, n, w = self.batch_size, self.n_kv_heads, self.n_compressed, self._window_length()
        piece, starts = self._prefill_pieces(n // G)
        compiled, apart = _prefill_piece_mode()
        out = []
        for prefix, dim, window, decode in (
            ("key", self.head_dim, self.window_keys, decode_key_blocks),
            ("value", self.value_dim, self.window_values, decode_value_blocks),
        ):
            codes, scale, zero, _, sink, *sparse = self._reader_args(prefix)
            table = self._lookup_table(prefix, dim)
            per_token = prefix == "value"  # value scales are per token, key scales per block
            full = mx.zeros((B, H, n + w, dim), dtype)
            for b0 in starts:
                b1 = b0 + piece
                s0, s1 = (b0 * G, b1 * G) if per_token else (b0, b1)
                args = [codes[:, :, b0:b1], scale[:, :, s0:s1], zero[:, :, s0:s1], table]
                args += [a[:, :, b0:b1] for a in sparse]
                if b0 == 0:
                    args.append(sink)
                fn = _prefill_piece_function(
                    prefix, self.code_bits, G, dim, bool(sparse), b0 == 0, self.dtype, dtype, compiled, apart
                )
                full[:, :, b0 * G : b1 * G] = fn(*args)
            if w:
                full[:, :, n:] = window.astype(dtype)
            out.append(full)
        return out[0], out[1]


    def _kernel_keys_values(self, queries: mx.array) -> tuple[mx.array, mx.array]:
        """`_prefill_keys_values` on MLX's CUDA backend: the whole history of each part
        and its window written by one kernel (kvquant_prefill_kernel.py) into the result; the
        kernels' inputs wait for the queries (the base's ordering step, no host sync)."""
        n, w, G, dtype = self.n_compressed, self._window_length(), self.group_size, queries.dtype
        out = []
        for prefix, dim, window in (("key", self.head_dim, self.window_keys), ("value", self.value_dim, self.window_values)):
            codes, scale, zero, codebook, sink, *sparse = self._reader_args(prefix)
            codes, scale, zero = self._inputs_after_queries((codes, scale, zero), queries)
            out.append(kvquant_prefill_kernel.history_decode(
                codes, scale, zero, codebook, tuple(sparse) or None, sink, window if w else None,
                n_blocks=n // G, group=G, dim=dim, bits=self.code_bits, per_token=prefix == "value",
                cache_dtype=self.dtype, out_dtype=dtype,
            ))
        return out[0], out[1]


# ---- the prefill decode's pieces --------------------------------------------------------------


def _prefill_fusion_is_exact() -> bool:
    """Whether the compiled piece decode, fused as it comes, gives the uncompiled one's bits.
    On the CPU it does (MLX's fused CPU kernels are built for baseline x86-64, without FMA).
    Elsewhere the fused levels * scale + zero could be contracted into one FMA (nvrtc's
    default --fmad=true): the product of a float32 level and a 16-bit scale is not exact in
    float32, so the FMA would round once where the separate ops round twice."""
    return mx.default_device() == mx.cpu


def _prefill_piece_mode() -> tuple[bool, bool]:
    """(compiled, product apart) for the prefill pieces on the current device: compiled and
    fused on the CPU; elsewhere eager unless KVQuantCache.prefill_compiled_off_cpu, then
    compiled with the product written apart (kvquant_attention._apart), which keeps the bits.
    Eager is the default off the CPU because every distinct fused kernel is a JIT compile on
    a GPU's first use (~seconds each cold) while the eager ops are precompiled kernels; which
    is faster per chunk is for the next GPU session to measure (module docstring)."""
    if _prefill_fusion_is_exact():
        return True, False
    return (True, True) if KVQuantCache.prefill_compiled_off_cpu else (False, False)


@lru_cache(maxsize=None)
def _prefill_piece_function(prefix, bits, group, dim, outliers, sink, cache_dtype, out_dtype, compiled, apart=False):
    """(codes, scale, zero, table[, positions, exact][, sink]) of one piece of blocks -> its
    K or V in out_dtype: decode_key_blocks / decode_value_blocks over the whole piece (block
    0 of the piece is the history's first when `sink`), cast to the cache dtype and then to
    out_dtype as `_decode` and the base's prefill do. Through mx.compile when `compiled`;
    `apart`: the scaled levels written out before the zero is added (no FMA can form)."""
    decode = decode_key_blocks if prefix == "key" else decode_value_blocks

    def piece(codes, scale, zero, table, *rest):
        sparse = tuple(rest[:2]) if outliers else None
        first = rest[-1] if sink else None
        n = codes.shape[2]
        x = decode(codes, scale, zero, None, 0, n, bits, group, dim, sparse, first, table, product_apart=apart)
        return x.astype(cache_dtype).astype(out_dtype)

    return mx.compile(piece) if compiled else piece


# ---- the encoder's pure parts, through mx.compile ---------------------------------------------
# One compiled function per setting (mx.compile traces again per input shape). Fusing the
# elementwise ops around the reductions shrinks the encoder's lazy graph for a 2048-token chunk
# of one 8 x 128 layer from 108 non-view nodes to 60 (772 to 394 on the first chunk, with the
# codebook fits; `python -m tests.cache.bench_encoders`), and the passes over the data with them;
# every reduction, argpartition and scatter is the same op on the same array as before, so what
# is stored is bit-identical (tests/cache/test_encoder_identity.py compares with the encoder of
# main 2e28496).


def _fusion_is_exact(vector_length: int) -> bool:
    """Whether the compiled normalize stores what the uncompiled one does. A vector's mean is
    its sum times 1 / length, and the fused `x - sum * (1 / length)` of the outlier scores may
    become one FMA where the fused kernel is built to allow it: MLX's CUDA JIT runs nvrtc with
    its default --fmad=true (for this pattern nvcc emits mul.f32 / sub.f32 without .rn, which
    ptxas may contract). That product is exact, so the FMA changes nothing, when the length is
    a power of two (every kvquant group size; head_dim 64 or 128). MLX's fused CPU kernels are
    built with g++ -O3 for baseline x86-64, which has no FMA."""
    return mx.default_device() == mx.cpu or vector_length & (vector_length - 1) == 0


@lru_cache(maxsize=None)
def _compiled_normalize(count: int, axis: int, dtype: mx.Dtype):
    return mx.compile(_normalize_function(count, axis, dtype))


@lru_cache(maxsize=None)
def _normalize_function(count: int, axis: int, dtype: mx.Dtype):
    """blocks (B, H, nb, G, D) -> (normalized float32, zero, scale[, positions, outlier values]):
    outliers taken out (holes filled with their vector's mean), then each vector (a channel over
    the block's tokens for axis -2, a token for -1) mapped to [-1, 1] by its mid-range and
    half-range, rounded to the cache dtype as stored."""

    def normalize(blocks: mx.array):
        dense = blocks.astype(mx.float32)
        sparse = []
        if count:
            positions = select_outliers(blocks, count, axis)
            sparse = [positions, gather_entries(blocks, positions).astype(dtype)]
            dense = replace_with_vector_mean(dense, positions, axis)
        lo, hi = dense.min(axis=axis), dense.max(axis=axis)
        zero = ((hi + lo) * 0.5).astype(dtype)
        scale = mx.maximum((hi - lo) * 0.5, MIN_SCALE).astype(dtype)
        z32, s32 = zero.astype(mx.float32), scale.astype(mx.float32)
        if axis == -2:
            normalized = (dense - z32[..., None, :]) / s32[..., None, :]
        else:
            normalized = (dense - z32[..., None]) / s32[..., None]
        return (normalized, zero, scale, *sparse)

    return normalize


@lru_cache(maxsize=None)
def _ranking_function(count: int, axis: int, compiled: bool):
    """blocks -> sparse_outliers.outlier_ranking (select_outliers' argpartition, read in place
    by kvquant_encode_kernel.py), through mx.compile where fusion is exact (`_fusion_is_exact`:
    the same ops and the same condition as in `_normalize_function`)."""

    def ranking(blocks: mx.array) -> mx.array:
        return outlier_ranking(blocks, count, axis)

    return mx.compile(ranking) if compiled else ranking


def _outlier_ranking(blocks: mx.array, count: int, axis: int) -> mx.array:
    """The outliers' ranking kvquant_encode_kernel.py reads, per block: on CUDA the selection
    kernel's `count` picks from the compiled scores (outlier_select_kernel.py: no sort; the
    same outliers wherever the count-th score is not tied, in ascending score order), else the
    whole argpartition, its first `count` read in place."""
    exact = _fusion_is_exact(blocks.shape[axis])
    if outlier_select_kernel.applies(blocks.shape[-2] * blocks.shape[-1], count):
        return outlier_select_kernel.smallest(_scores_function(axis, exact)(blocks), count)
    return _ranking_function(count, axis, exact)(blocks)


@lru_cache(maxsize=None)
def _scores_function(axis: int, compiled: bool):
    """blocks -> sparse_outliers.outlier_scores, through mx.compile where fusion is exact (as
    `_ranking_function`)."""

    def scores(blocks: mx.array) -> mx.array:
        return outlier_scores(blocks, axis)

    return mx.compile(scores) if compiled else scores


@lru_cache(maxsize=None)
def _compiled_codes(bits: int):
    """normalized (B, H, nb, G, D), codebook (B, H, 2**bits) -> packed codes (B, H, nb, words)."""

    def codes(normalized: mx.array, codebook: mx.array) -> mx.array:
        B, H, nb = normalized.shape[:3]
        return pack_codes(nearest_level(normalized, codebook).reshape(B, H, nb, -1), bits)

    return mx.compile(codes)
