"""TurboQuantRVQCache's encoder and prefill decode as they were at main 714de0c, frozen, to check
the compiled ones.

turboquant_rvq.py's `_encode` and `_prefill_keys_values` now run their elementwise parts through
mx.compile with the promise that they store, and decode, exactly what these did: the same stage
codes, scales, zeros, sign words, magnitudes, key mean and sink deltas, and the same decoded K/V,
bit for bit. tests/cache/test_turboquant_rvq_encoder_identity.py compares the two, and
tests/cache/bench_turboquant_rvq_encoder.py times them side by side. Do not "fix" or speed up
this file: it is the specification of the stored bits. (The helpers it calls, hadamard.rotate /
unrotate, sign_plane.sign_values and packing.pack_codes, were left unchanged by that work.)
"""

from __future__ import annotations

import mlx.core as mx

from veloxquant_mlx.cache.hadamard import rotate, unrotate
from veloxquant_mlx.cache.packing import pack_codes
from veloxquant_mlx.cache.sign_plane import sign_values
from veloxquant_mlx.cache.turboquant_rvq import SIDE_DTYPE, TurboQuantRVQCache


class ReferenceTurboQuantRVQCache(TurboQuantRVQCache):
    """TurboQuantRVQCache whose encoder, stage read-back and prefill decode are main 714de0c's."""

    def _encode(self, keys, values):
        if self._signs is None:
            self._make_signs()
        if self.key_mean is None:
            self.key_mean = mx.mean(keys.astype(mx.float32), axis=2, keepdims=True).astype(keys.dtype)
        out = {}
        k = keys.astype(mx.float32) - self.key_mean.astype(mx.float32)
        out.update(self._ref_encode_part("k", rotate(k, self._signs[0]), self.key_bits))
        out.update(self._ref_encode_part("v", rotate(values.astype(mx.float32), self._signs[1]), self.value_bits))
        sink = min(self.exact_sink_tokens, keys.shape[2])
        if self.n_compressed == 0 and sink > 0:
            k_hat, v_hat = self._ref_reconstruct(out, sink)
            self.sink_deltas = (
                keys[:, :, :sink].astype(mx.float32) - k_hat,
                values[:, :, :sink].astype(mx.float32) - v_hat,
            )
        return out

    def _ref_encode_part(self, p, y, total):
        out = {}
        residual = y
        stages = self._stages(total)
        for i, b in stages:
            if b == 1:
                out[f"{p}_codes{i}"] = pack_codes(residual >= 0, 1)
                out[f"{p}_scale{i}"] = mx.mean(mx.abs(residual), axis=-1, keepdims=True).astype(SIDE_DTYPE)
            else:
                codes, scales, zeros = mx.quantize(residual, group_size=self._group(y.shape[-1]), bits=b)
                out[f"{p}_codes{i}"] = codes
                out[f"{p}_scales{i}"] = scales.astype(SIDE_DTYPE)
                out[f"{p}_zeros{i}"] = zeros.astype(SIDE_DTYPE)
            if (i, b) != stages[-1]:
                residual = residual - self._ref_stage_values(p, i, b, y.shape[-1], store=out)
        return out

    def _ref_stage_values(self, p, i, b, dim, store=None, n=None, start=0):
        store = self.store if store is None else store
        cut = (lambda a: a) if n is None and start == 0 else (lambda a: a[:, :, start:n])
        codes = cut(store[f"{p}_codes{i}"])
        if b == 1:
            return sign_values(codes, cut(store[f"{p}_scale{i}"]))
        scales = cut(store[f"{p}_scales{i}"]).astype(mx.float32)
        zeros = cut(store[f"{p}_zeros{i}"]).astype(mx.float32)
        return mx.dequantize(codes, scales, zeros, group_size=self._group(dim), bits=b)

    def _ref_decode_part(self, p, dim, total, n, store=None, start=0):
        y = None
        for i, b in self._stages(total):
            part = self._ref_stage_values(p, i, b, dim, store=store, n=n, start=start)
            y = part if y is None else y + part
        return y

    def _ref_reconstruct(self, store, n, start=0):
        k = unrotate(self._ref_decode_part("k", self.head_dim, self.key_bits, n, store, start), self._signs[0])
        k = k + self.key_mean.astype(mx.float32)
        v = unrotate(self._ref_decode_part("v", self.value_dim, self.value_bits, n, store, start), self._signs[1])
        return k, v

    def _ref_decode_range(self, start, stop, part="kv"):
        out = []
        if "k" in part:
            k = unrotate(self._ref_decode_part("k", self.head_dim, self.key_bits, stop, self.store, start),
                         self._signs[0]) + self.key_mean.astype(mx.float32)
            out.append(self._with_sink(k, 0, start).astype(self.dtype))
        if "v" in part:
            v = unrotate(self._ref_decode_part("v", self.value_dim, self.value_bits, stop, self.store, start),
                         self._signs[1])
            out.append(self._with_sink(v, 1, start).astype(self.dtype))
        return tuple(out) if len(out) > 1 else out[0]

    def _decode(self):
        return self._ref_decode_range(0, self.n_compressed)

    def _prefill_keys_values(self, queries):
        if not self.n_compressed:
            return super(TurboQuantRVQCache, self)._prefill_keys_values(queries)
        dtype = queries.dtype
        if self.prefill_eval_queries:
            mx.eval(queries, *[a for a in (self.window_keys, self.window_values) if a is not None])
        n, w = self.n_compressed, self._window_length()
        B, H = self.batch_size, self.n_kv_heads
        per_token = B * H * max(self.head_dim, self.value_dim) * 4
        blocks = self.prefill_decode_bytes // per_token // self.block_size
        piece = max(1, blocks) * self.block_size
        out = []
        parts = ((self.head_dim, self.window_keys), (self.value_dim, self.window_values))
        for which, (dim, window_part) in enumerate(parts):
            full = mx.zeros((B, H, n + w, dim), dtype)
            for start in range(0, n, piece):
                stop = min(n, start + piece)
                full[:, :, start:stop] = self._ref_decode_range(start, stop, "kv"[which]).astype(dtype)
                mx.eval(full)
            if w:
                full[:, :, n:] = window_part.astype(dtype)
            out.append(full)
        return out[0], out[1]
