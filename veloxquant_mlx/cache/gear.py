"""GEAR: uniform quantization + low-rank residual + sparse outliers, read in compressed form.

Kang et al. 2024, "GEAR: An Efficient KV Cache Compression Recipe for Near-Lossless Generative
Inference of LLM", arXiv 2403.05527. Each K and V matrix X of a head is stored as
    X ~ Q(D) + A B^T + S,   D = X with the outliers S taken out,
  * S: the `gear_outlier_fraction` entries of each block that would stretch a quantization
    group most, as fp16 values + uint16 indices (gear_outliers.py);
  * Q(D): `gear_bits` uniform affine codes from mx.quantize (packed uint32 words, fp16 scale and
    zero per group of `gear_group_size`). Keys per channel (groups along tokens), values per
    token (groups along head_dim): the KIVI grouping the paper pairs GEAR with ("GEAR-KIVI");
  * A B^T: rank `gear_rank` approximation of the residual D - Q(D), per block of tokens per
    head, by power iteration as in the paper (gear_lowrank.py); A (tokens x r), B (d x r) fp16.

Attention never dequantizes the history: scores = quantized_matmul(q, K codes) +
(q B_k) A_k^T + sparse; output = quantized_matmul(p, V codes) + (p A_v) B_v^T + sparse. On MLX's
CUDA backend a decode step computes the same in two kernels (fused_decode_gear.py).

The encoder (gear_encoder.py) runs in compiled stages around the argpartition, mx.quantize and
the power iteration; it stores the same bits as the uncompiled ops did
(tests/cache/test_encoder_identity.py). On CUDA the power iteration is one kernel per side
(gear_power_kernel.py, session 17: gear's 32K prefill on the H200 2.02x -> 1.33x fp16's in one
process), whose factors differ from the ops' in their last bits (its own order of sums). On the
CPU that is hardly faster (1.02-1.06x for a 2048-token chunk of one 8 x 128 layer: argpartition
and mx.quantize dominate); on a GPU it
removes kernel launches (unmeasured; see gear_encoder.py and gear_lowrank.COMPILE_ON_GPU).

Rank setting: `gear_rank` (default 4) is the rank per block of BLOCK_TOKENS = 256 tokens per
head, for keys and values alike. With head_dim 64, 2 bits, group 32, rank 4 and 1% outliers the
accounting is 2 (codes) + 1 (scales, zeros) + 1 (A) + 0.25 (B) + 0.32 (S) = 4.57 bits per element,
0.286x fp16; rank 0 or outlier fraction 0 drops those arrays altogether.

Measured (results/gear_quality.json, gear_quality_ablation.json, gear_speed.json): on
SmolLM2-135M with the DESIGN.md protocol, gear-2 KL(ref || gear) ~0.02 (0.03 over the positions
that read a compressed history) against 2.16 for mlx-lm's QuantizedKVCache 2-bit g32; without
the low-rank term (rank 0) 0.030. Bytes after a 4096-token prompt: 0.286x the fp16 KVCache.

Prefill (session 5). On the H200 (8B-shaped llama, 8 layers, bf16, 32K prompt in 2048-token
chunks) gear's prefill took 1.78 s against fp16's 0.41 s (4.4x; results/gpu_speed_h200_s4.json),
~10 ms per layer and chunk above fp16. A prefill chunk's attention decodes the layer's whole
history for mx.fast attention (`_prefill_keys_values`) and `_flush` encodes the chunk. Measured
on the CPU per chunk of one 8 x 128 layer up to 16K (tests/cache/test_gear_prefill_probe.py):
neither makes a host sync of its own (the base's evaluation of the queries is the one per
chunk) and nothing is traced again after the first chunk (the encoder's 7 compiled stages are
traced once: a chunk is always 2048 tokens). The history decode was one uncompiled graph of
118 primitives (~50 on a GPU, where mx.dequantize is one kernel and not the CPU's ~64 shifts),
whatever the history, holding float32 intermediates of the whole history: one layer's decode
added 7.5-7.9x the history's fp16 K/V at its peak (bf16, 16K and 32K). The encoder builds ~290
primitives per chunk (~390 on CUDA before session 6's gear_encode_kernel.py, ~206 with it: the
power iteration is not compiled there, see gear_lowrank.COMPILE_ON_GPU; 88 since session 17's
gear_power_kernel.py), the same at every history. `_prefill_keys_values` now
  1. decodes the history in pieces of `prefill_decode_bytes` of float32 (8192 tokens of 8 x 128)
     through one compiled function (decode_side under mx.compile: the adds, casts and index
     arithmetic fuse; ~32 primitives per piece pair on a GPU, estimated the same way), so its input
     shapes repeat from chunk to chunk (the lengths P and n mod P: four with 2048-token chunks,
     traced in the first four chunks and reused after);
  2. adds the sparse part in place (gear_outliers.add_block_entries) instead of a dense
     float32 zero array of the history plus an add;
  3. fills one result in the queries' dtype piece by piece (no concatenation with the window,
     no cast of the whole history).
Measured (CPU, bf16, one more chunk over the history, python -m
tests.cache.test_gear_prefill_probe --compare 16384,32768; results/gear_prefill_cpu_s5.json):
with session 5's host syncs the peak it added was 2.62x / 1.86x the fp16 K/V at 16K / 32K history
(7.5-7.9x before), bits identical to the one-graph decode (tests/cache/test_gear_prefill.py,
against a frozen copy of it).

Prefill (session 6). On the H200 gear's 32K prefill still took 4.03x fp16's. Session 5's path
made host syncs per layer and chunk: the base class's evaluation of the queries, and once the
history passed 8192 tokens one per piece but the last (1, 4, 6, 8 at 2K-8K, 10K-16K, 18K-24K,
26K-30K: 68 per layer over a 32K prompt, 544 over 8 layers), each draining the GPU queue and
stopping the host from building ahead. Now:
  1. no host sync: the order the syncs gave is made inside the graph (_prefill_order: the first
     piece's inputs and the result's zeros wait for the queries, each further piece's inputs
     for the result as filled so far; gear.PREFILL_HOST_SYNCS = True restores session 5's
     syncs for an A/B);
  2. pieces of 8 MiB of float32 (2048 tokens of 8 x 128) instead of 32: without syncs the host
     queues the next piece's first ops while the previous one runs, which added ~2 pieces'
     temporaries at 32 MiB (3.54x / 2.34x the fp16 K/V at 16K / 32K); at 8 MiB one layer's
     decode adds 1.63x / 1.84x (session 5: 2.62x / 1.86x), bits unchanged;
  3. on MLX's CUDA backend one kernel writes the whole prefill K/V (gear_prefill_kernel.py:
     one launch per layer and chunk instead of ~16 per piece and side, no float32
     intermediates; its inputs wait for the queries by mx.depends), bit for bit the portable
     path under the CPU emulation.
Measured on the CPU (results/gear_prefill_cpu_s6.json; bf16, one 8 x 128 layer, bits unchanged):
per chunk of a 32K fill the K/V build took 0.67-0.83x session 5's time (median 0.76; 30K:
710 ms against 873; alternated on the same history), with 0 host syncs against 1-8 and 0 retraces
after the first chunk (one piece shape), but 70-966 CPU primitives against 66-252 (4x the pieces);
a 4-layer model's 16K prefill peaked 0.233 GiB over its start against 0.593 in session 5 (fp16's
KVCache 0.41; 0.302 without the queries' ordering). The chunk's encode (~290 primitives on the
CPU; on CUDA ~390, ~206 through gear_encode_kernel.py, results/gear_encode_s6.json; no sync, no
retrace after the first chunk; ~165 ms per chunk here) is unchanged by the prefill change. Nothing of this is measured on a GPU yet; the next GPU session:
    pytest -m cuda tests/cache/test_gear_prefill_kernel.py
    python -m veloxquant_mlx.bench.kernel_probe --parts prefill --methods gear --out X.json
    python -m veloxquant_mlx.bench.gpu_speed --methods fp16,gear --contexts 32768 --repeats 3
and the same two benches with VELOXQUANT_CUDA_KERNELS=0 (the portable path, no syncs) and with
`--set gear.PREFILL_HOST_SYNCS=1` added to kernel_probe (session 5's syncs).

Deviations from the paper, all deliberate:
  1. Blocks: the paper approximates the whole prefill at once and then each buffer of n_b new
     tokens; we compress every block of 256 tokens independently (prefill included), so
     prefill and decode store the same layout and a block never changes once written. The
     exact window (the paper's streaming buffer) holds the 0..255 most recent tokens.
  2. Outlier selection: the paper keeps the s/2 largest and s/2 smallest entries of the matrix;
     we keep the s entries farthest from their quantization group's mean, per block of 256
     tokens per head (same count), which targets the entries that widen a group's range (see
     gear_outliers.py). On the real model (results/gear_quality_ablation.json) this halves the
     loss of the literal largest-|x| rule: KL 0.023 vs 0.039 at 2 bits; equal on synthetic data.
  3. The sparse values are stored as the correction X - Q(D) - A B^T at their positions, so the
     three parts add; a selected entry comes back exact up to fp16 rounding of the correction.
  4. Side data (scales, zeros, factors, outlier values) is fp16 (bf16 for bf16 input) whatever
     the input dtype; float32 K/V are rounded to fp16 before quantizing.
  5. Power iteration uses a fixed starting matrix (deterministic encoding) and 3 steps.
"""

from __future__ import annotations

from functools import lru_cache
from typing import ClassVar, NamedTuple

import mlx.core as mx

from veloxquant_mlx.cache import fused_decode_gear, gear_prefill_kernel, prefill_pieces, unpacked_products
from veloxquant_mlx.cache.base import CompressedKVCache, StoreArray
from veloxquant_mlx.cache.gear_attention import scores_function, values_function
from veloxquant_mlx.cache.gear_encoder import EncoderSetting, dequantize, encode_sides, group_means
from veloxquant_mlx.cache.gear_outliers import add_block_entries, index_dtype, pairs_in_position_order
from veloxquant_mlx.errors import QuantizerConfigError

# Tokens per low-rank / outlier block; also the base's encoding unit and growth step, so a
# block's factors are written once. 256 keeps B's cost at r*16/256 bits per element (see above).
BLOCK_TOKENS = 256


class GEARCache(CompressedKVCache):
    method = "gear"
    step = BLOCK_TOKENS
    # Tokens per block (a subclass may shrink it for experiments; it must divide `step`).
    block_tokens: ClassVar[int] = BLOCK_TOKENS

    def _setup(self) -> None:
        # Not named `bits` / `group_size`: mlx-lm's scaled_dot_product_attention sends any cache
        # with a `bits` attribute down its QuantizedKVCache path, which would break unpatched use.
        self.code_bits = self.config.gear_bits
        self.code_group = self.config.gear_group_size
        self.rank = self.config.gear_rank
        self.outlier_fraction = float(self.config.gear_outlier_fraction)

    @property
    def block_size(self) -> int:
        return self.block_tokens

    @property
    def side_dtype(self) -> mx.Dtype:
        return mx.bfloat16 if self.dtype == mx.bfloat16 else mx.float16

    def _outlier_count(self, dim: int) -> int:
        if self.outlier_fraction == 0:
            return 0
        return max(1, round(self.outlier_fraction * self.block_tokens * dim))

    def _check_shape(self, head_dim: int, value_dim: int) -> None:
        for label, dim in (("head_dim", head_dim), ("value head_dim", value_dim)):
            if dim % self.code_group:
                raise QuantizerConfigError(
                    f"GEARCache (layer {self.layer_index}): {label}={dim} is not a multiple of "
                    f"gear_group_size={self.code_group}; allowed is a multiple of the group size "
                    "(values are quantized per token in groups along head_dim)"
                )
            if self.rank > min(dim, self.block_tokens):
                raise QuantizerConfigError(
                    f"GEARCache (layer {self.layer_index}): gear_rank={self.rank} exceeds "
                    f"{label}={dim} or the block of {self.block_tokens} tokens; allowed is "
                    f"0..{min(dim, self.block_tokens)}"
                )

    # ---- storage ----------------------------------------------------------------------------
    def _store_layout(self) -> list[StoreArray]:
        D, Dv, g, side = self.head_dim, self.value_dim, self.code_group, self.side_dtype
        words = self.code_bits  # 32 tokens of one channel at `bits` bits fill `bits` uint32 words
        layout = [
            StoreArray("k_codes", 3, 32, mx.uint32, (D, -1, words)),
            StoreArray("k_scales", 3, g, side, (D, -1)),
            StoreArray("k_zeros", 3, g, side, (D, -1)),
            StoreArray("v_codes", 2, 1, mx.uint32, (-1, Dv * self.code_bits // 32)),
            StoreArray("v_scales", 2, 1, side, (-1, Dv // g)),
            StoreArray("v_zeros", 2, 1, side, (-1, Dv // g)),
        ]
        for s, dim in (("k", D), ("v", Dv)):
            if self.rank:
                layout.append(StoreArray(f"{s}_lr_tokens", 2, 1, side, (-1, self.rank)))
                layout.append(StoreArray(f"{s}_lr_channels", 2, self.block_tokens, side, (-1, dim, self.rank)))
            count = self._outlier_count(dim)
            if count:
                layout.append(StoreArray(f"{s}_out_values", 2, self.block_tokens, side, (-1, count)))
                layout.append(
                    StoreArray(f"{s}_out_index", 2, self.block_tokens, index_dtype(self.block_tokens * dim), (-1, count))
                )
        return layout

    def bits_per_element(self) -> float:
        """Stored bits per cached K/V element of the compressed history (growth slack aside)."""
        side_bits = 16
        per_token = 0.0
        for dim in (self.head_dim, self.value_dim):
            per_token += dim * (self.code_bits + 2 * side_bits / self.code_group)
            per_token += self.rank * side_bits * (1 + dim / self.block_tokens)
            index_bits = 8 * index_dtype(self.block_tokens * dim).size
            per_token += self._outlier_count(dim) * (side_bits + index_bits) / self.block_tokens
        return per_token / (self.head_dim + self.value_dim)

    # ---- encoding ---------------------------------------------------------------------------
    def _encode(self, keys: mx.array, values: mx.array) -> dict[str, mx.array]:
        # Both sides together: on CUDA their outlier selections and power iterations pair into
        # one launch each (gear_encoder.encode_sides).
        sides = [self._side_encoding(keys, per_channel=True), self._side_encoding(values, per_channel=False)]
        return {f"{s}_{name}": array for s, arrays in zip("kv", encode_sides(sides)) for name, array in arrays.items()}

    def _group_means(self, blocks: mx.array, per_channel: bool, weights=None) -> mx.array:
        """Each entry's quantization-group mean (over `weights`-selected entries if given)."""
        return group_means(blocks, self.code_group, per_channel, weights)

    def _selection_centres(self, blocks: mx.array, per_channel: bool) -> mx.array:
        """What an outlier's distance is measured from: its quantization group's mean."""
        return self._group_means(blocks, per_channel)

    def _side_encoding(self, x: mx.array, per_channel: bool) -> tuple:
        """What gear_encoder.encode_sides takes for one side: its setting, its blocks in float32,
        the outliers' centres where a subclass has its own (else None)."""
        B, H, n, d = x.shape
        blocks = x.astype(mx.float32).reshape(B, H, n // self.block_tokens, self.block_tokens, d)
        count = self._outlier_count(d)
        # A subclass's own centres (bench/ablations.py) are computed here and passed in; the
        # default, the group means, is computed inside the compiled stage, fused.
        own_centres = type(self)._selection_centres is not GEARCache._selection_centres
        centres = self._selection_centres(blocks, per_channel) if count and own_centres else None
        setting = EncoderSetting(
            self.code_bits, self.code_group, self.rank, count, self.block_tokens, self.side_dtype, per_channel
        )
        return setting, blocks, centres

    # ---- decoding (unpatched path, trim, to_quantized; the prefill's pieces) -----------------
    def _decode(self) -> tuple[mx.array, mx.array]:
        keys, values = self.decode_float32()
        return keys.astype(self.dtype), values.astype(self.dtype)

    def decode_float32(self) -> tuple[mx.array, mx.array]:
        """The compressed history as float32 K, V (what the compressed attention computes with)."""
        n = self.n_compressed
        return tuple(
            decode_side(self._decode_setting(s, self.dtype), *self._side_range(s, 0, n), dequantize_fn=self._dequantize)
            for s in ("k", "v")
        )

    def _dequantize(self, codes, scales, zeros) -> mx.array:
        return dequantize(codes, scales, zeros, self.code_group, self.code_bits)

    def _decode_setting(self, s: str, out_dtype: mx.Dtype) -> DecodeSetting:
        return DecodeSetting(
            self.code_bits, self.code_group, self.rank, f"{s}_out_values" in self.store, self.block_tokens,
            s == "k", self.dtype, out_dtype,
        )

    def _side_range(self, s: str, start: int, stop: int) -> list[mx.array]:
        """The stored arrays of side `s` ("k" or "v") for the compressed tokens [start, stop)
        (block-aligned), in decode_side's order: codes, scales, zeros, then the low-rank factors
        and the outliers where kept. Views of the store: nothing is copied."""
        g, nb, st = self.code_group, self.block_tokens, self.store
        if s == "k":  # per channel: tokens along the last axes (32 codes of a channel per word row)
            groups = slice(start // g, stop // g)
            words = slice(start // 32, stop // 32)
            arrays = [st["k_codes"][:, :, :, words], st["k_scales"][..., groups], st["k_zeros"][..., groups]]
        else:
            arrays = [st[f"v_{name}"][:, :, start:stop] for name in ("codes", "scales", "zeros")]
        blocks = slice(start // nb, stop // nb)
        if self.rank:
            arrays += [st[f"{s}_lr_tokens"][:, :, start:stop], st[f"{s}_lr_channels"][:, :, blocks]]
        if f"{s}_out_values" in st:
            arrays += [st[f"{s}_out_index"][:, :, blocks], st[f"{s}_out_values"][:, :, blocks]]
        return arrays

    # Bytes of one float32 (B, H, tokens, d) piece of history a prefill chunk decodes at a time;
    # None: the module's PREFILL_PIECE_BYTES (which `--set gear.PREFILL_PIECE_BYTES=...` can
    # change for a measurement). With PREFILL_HOST_SYNCS, float32 bytes of one side's history up
    # to which the pieces are not evaluated one by one (session 5's setting).
    prefill_decode_bytes: ClassVar[int | None] = None
    prefill_unsynced_bytes: ClassVar[int] = 32 << 20

    def _float32_bytes_per_token(self) -> int:
        return self.batch_size * self.n_kv_heads * max(self.head_dim, self.value_dim) * 4

    def _prefill_piece_tokens(self) -> int:
        budget = PREFILL_PIECE_BYTES if self.prefill_decode_bytes is None else self.prefill_decode_bytes
        return prefill_pieces.piece_tokens(budget, self._float32_bytes_per_token(), self.block_tokens)

    def _prefill_keys_values(self, queries: mx.array) -> tuple[mx.array, mx.array]:
        """The history decoded + the exact window in the queries' dtype, for a prefill chunk's
        fused attention: bit for bit what the base class's path (the whole `_decode`, then the
        window concatenated) gives, built in fixed-size pieces through one compiled function
        (see "Prefill" in the module docstring). No host sync (PREFILL_HOST_SYNCS: session 5's
        syncs, for an A/B): the order the syncs gave is made inside the graph instead (see
        _prefill_order)."""
        if not self.n_compressed or type(self)._dequantize is not GEARCache._dequantize:
            # A subclass's own dequantization (tests' reference encoders) goes the generic way.
            return super()._prefill_keys_values(queries)
        fused = gear_prefill_kernel.prefill_step(self, queries)
        if fused is not None:  # one CUDA kernel (gear_prefill_kernel.py)
            return fused
        if PREFILL_HOST_SYNCS:
            self._order_after_queries(queries)  # session 5: evaluate the queries first
        dtype, n, w = queries.dtype, self.n_compressed, self._window_length()
        piece = self._prefill_piece_tokens()
        synced = PREFILL_HOST_SYNCS and n * self._float32_bytes_per_token() > self.prefill_unsynced_bytes
        # What the next array built must wait for: the queries first (the base class's
        # prefill_eval_queries), then the result as filled so far.
        after = [queries] if self.prefill_eval_queries and not PREFILL_HOST_SYNCS else []
        out = []
        sides = (("k", self.head_dim, self.window_keys), ("v", self.value_dim, self.window_values))
        for s, dim, window in sides:
            decode = compiled_decoder(self._decode_setting(s, dtype))
            # Allocated once and filled piece by piece: the full-history array is the result
            # itself and no concatenation with the window copies it again.
            full = mx.full((self.batch_size, self.n_kv_heads, n + w, dim), _prefill_order(mx.array(0, dtype), after))
            for start in range(0, n, piece):
                stop = min(n, start + piece)
                full[:, :, start:stop] = decode(*_prefill_order(self._side_range(s, start, stop), after))
                if PREFILL_HOST_SYNCS:
                    if synced and not (s == "v" and stop == n):
                        mx.eval(full)  # session 5's per-piece evaluation
                else:
                    after = [full]
            if w:
                full[:, :, n:] = window.astype(dtype)
            out.append(full)
        return out[0], out[1]

    # ---- attention over the compressed form ---------------------------------------------------
    def _side(self, s: str) -> list[mx.array]:
        names = [f"{s}_codes", f"{s}_scales", f"{s}_zeros"]
        if self.rank:
            names += [f"{s}_lr_tokens", f"{s}_lr_channels"]
        if f"{s}_out_values" in self.store:
            names += [f"{s}_out_index", f"{s}_out_values"]
        return [self.store[n] for n in names]

    def _scores(self, q: mx.array) -> mx.array:
        outliers = "k_out_values" in self.store
        fn = scores_function(
            self.code_bits, self.code_group, self.rank, outliers, self.block_tokens, self.head_dim, _on_cpu()
        )
        return fn(q, *self._side("k"))

    @CompressedKVCache.state.setter
    def state(self, v):
        """The base's loading, then each block's outlier pairs in ascending position: a state
        saved before session 29 holds them in the selection's order, which the CUDA decode
        kernel's scan of a tile's run (fused_decode_gear.SORTED_SCAN) would misread."""
        CompressedKVCache.state.fset(self, v)
        self.store = pairs_in_position_order(self.store)

    def _fused_decode(self, queries: mx.array, scale: float):
        # On CUDA (fused_decode.kernels_enabled) a decode step runs as two kernels over the
        # store (fused_decode_gear.py); None elsewhere: the portable path below.
        return fused_decode_gear.decode_step(self, queries, scale)

    def _weighted_values(self, p: mx.array) -> mx.array:
        outliers = "v_out_values" in self.store
        settings = (self.code_bits, self.code_group, self.rank, outliers, self.block_tokens, self.value_dim, _on_cpu())
        if unpacked_products.serves(self.code_bits):
            # The CPU: the codes' product read as planes for BLAS products (2.3-2.5x MLX's
            # kernel for kivi's and xquant's values, session 39), made outside the compiled
            # function; the low-rank and sparse terms inside it.
            codes, scales, zeros, *side = self._side("v")
            out = unpacked_products.affine_weighted_sum(p, codes, scales, zeros, group_size=self.code_group,
                                                        bits=self.code_bits)
            return values_function(*settings, codes_given=True)(p, out, *side)
        return values_function(*settings)(p, *self._side("v"))


def _on_cpu() -> bool:
    """Whether attention runs on the CPU (gear_attention computes in float32 there)."""
    return mx.default_device() == mx.cpu


# Session 5's host syncs in the portable prefill decode: the queries evaluated before the
# history is built (the base class's _order_after_queries) and, once one side's history exceeds
# `prefill_unsynced_bytes` of float32, the result evaluated after every piece. Off: the same
# order is made inside the graph (_prefill_order) and a prefill chunk makes no host sync of its
# own. True only to measure what the syncs cost (`--set gear.PREFILL_HOST_SYNCS=1`).
PREFILL_HOST_SYNCS = False

# Bytes of one float32 piece of history the portable prefill decode builds at a time (2048
# tokens of 8 kv heads x 128; 32 MiB, 8192 tokens, until session 5). Without host syncs the host
# queues the next piece's first ops (allocating their outputs) while the previous piece still
# runs, so about two pieces' float32 temporaries join the one piece's the syncs held: measured
# on the CPU (one layer, bf16, tests/cache/test_gear_prefill_probe.compare_paths), the decode
# adds 1.63x / 1.84x the fp16 K/V at a 16K / 32K history at 8 MiB, 3.54x / 2.34x at 32 MiB
# without syncs, 2.62x / 1.86x with session 5's syncs at 32 MiB. Smaller pieces cost more
# primitives per chunk (~32 per piece pair): on CUDA the prefill kernel replaces them.
PREFILL_PIECE_BYTES = 8 << 20


def _prefill_order(arrays, after: list):
    """`arrays` (one array or a list) made to wait for `after` (mx.depends; unchanged if empty).

    Why: the pieces of a prefill decode read only the evaluated store, so nothing in the graph
    orders them after the model up to this layer, nor after each other: MLX's scheduler (breadth
    first from the leaves) may then decode every layer's pieces, and allocate every layer's
    result, before any layer's attention runs, and hold all their float32 temporaries at once.
    Session 5 bounded that with host syncs (the queries' evaluation; one per piece beyond 8192
    tokens); here the first piece's inputs and the result's zeros wait for the queries, and each
    further piece's inputs for the result as filled by the pieces before it, so a piece's
    temporaries are made only once the previous piece is written (and freed), as the syncs
    ordered them, with no sync. The result's zeros must wait too: mx.full's only input is the
    fill value, so without it every layer's result would be allocated at the start."""
    single = isinstance(arrays, mx.array)
    arrays = [arrays] if single else list(arrays)
    if after:
        arrays = list(mx.depends(arrays, after))
    return arrays[0] if single else arrays


class DecodeSetting(NamedTuple):
    bits: int
    group: int
    rank: int
    outliers: bool
    block_tokens: int
    per_channel: bool  # keys: codes and scales along tokens per channel
    cache_dtype: mx.Dtype  # the decode rounds to it, as `_decode` does ...
    out_dtype: mx.Dtype  # ... then to the dtype the attention reads


def decode_side(setting: DecodeSetting, codes, scales, zeros, *side, dequantize_fn=None) -> mx.array:
    """One side's stored arrays for n block-aligned tokens (GEARCache._side_range's order) ->
    X = Q(D) + A B^T + S as float32 (B, H, n, d). Every term acts per token and per block, so
    any block-aligned split of the history decodes to the same values as one piece."""
    g, bits, nb = setting.group, setting.bits, setting.block_tokens
    dequantize_fn = dequantize_fn or (lambda c, s, z: dequantize(c, s, z, g, bits))
    B, H = codes.shape[:2]
    if setting.per_channel:
        dim, n = codes.shape[2], scales.shape[-1] * g
        x = dequantize_fn(codes.reshape(B, H, dim, n * bits // 32), scales, zeros).swapaxes(-1, -2)
    else:
        x = dequantize_fn(codes, scales, zeros)
    n, dim = x.shape[-2:]
    n_blocks = n // nb
    if setting.rank:
        tokens, channels, *side = side
        tokens = tokens.reshape(B, H, n_blocks, nb, setting.rank)
        low = tokens.astype(mx.float32) @ channels.astype(mx.float32).swapaxes(-1, -2)
        x = x + low.reshape(B, H, n, dim)
    if setting.outliers:
        index, values = side
        x = add_block_entries(x, index, values, nb)
    return x


# Whether the prefill's pieces are decoded through mx.compile. The fused kernels only add, cast
# and do integer index arithmetic (no float product feeding an add that nvrtc's default
# --fmad=true could contract into an FMA: the low-rank product is a matmul, and mx.dequantize is
# one primitive on a GPU; on the CPU its fallback's multiply-add is fused by g++ without FMA, see
# gear_lowrank.py), so it should store the same bits everywhere: tests/cache/test_gear_prefill.py
# checks them on the device it runs on (the CPU so far). Should it fail on CUDA, set this False:
# the same pieces then run uncompiled.
COMPILE_PREFILL_DECODE = True


@lru_cache(maxsize=None)
def compiled_decoder(setting: DecodeSetting):
    """decode_side (through mx.compile, see COMPILE_PREFILL_DECODE), rounded to the cache dtype,
    then to the output dtype: what `_decode` and the base class's cast to the queries' dtype
    give for the same tokens."""

    def decode(*arrays):
        return decode_side(setting, *arrays).astype(setting.cache_dtype).astype(setting.out_dtype)

    return mx.compile(decode) if COMPILE_PREFILL_DECODE else decode
