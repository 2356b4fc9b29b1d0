"""Attribute turboquant_rvq-4's error on the real model (DESIGN.md quality protocol): simulated
caches that return TurboQuantRVQCache's reconstruction of exactly the tokens the real cache
compresses (its compressed attention equals attention over its decoded K/V, tested), with one
part changed per variant: keys or values left exact, the first tokens left exact, no key
centering, a key mean without token 0, plain 4-bit uniform codes instead of 3 bits + sign,
stage-1 groups of 32. The simulation applies the codes alone, so "as_is" is the cache as it was
before it kept token 0 exact (commit f886f60: KL 0.0127, top-1 90.9% in results/bench_cpu.json),
and "first_token_exact" is what it does now.

  LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
  python scripts/attribute_turboquant_rvq_quality.py [variant ...]   # one JSON line per variant
"""
import json
import sys
import time

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.turboquant_rvq import TurboQuantRVQCache
from veloxquant_mlx.cache.hadamard import unrotate
from veloxquant_mlx.models.smollm2 import load_smollm2
from veloxquant_mlx.quality.kv_quality import measure_kv_quality, reference_run
from veloxquant_mlx.quality.passage import passage_tokens

class Sim(KVCache):
    def __init__(self, tq, keys=True, values=True, sink=0, center=True, mean_skip=0):
        super().__init__()
        self.tq, self.kq, self.vq, self.sink, self.center, self.mean_skip = tq, keys, values, sink, center, mean_skip
        self.rk = self.rv = None
    def _rec(self, kb, vb):
        tq = self.tq
        if tq.head_dim == 0:
            tq.batch_size, tq.n_kv_heads, tq.head_dim, tq.value_dim = kb.shape[0], kb.shape[1], kb.shape[3], vb.shape[3]
            tq.dtype = kb.dtype; tq._make_signs()
            if not self.center:
                tq.key_mean = mx.zeros((1, kb.shape[1], 1, kb.shape[3]), kb.dtype)
            elif self.mean_skip:
                tq.key_mean = mx.mean(kb[:, :, self.mean_skip:].astype(mx.float32), axis=2, keepdims=True).astype(kb.dtype)
        enc = tq._encode(kb, vb)
        out = []
        for p, dim, total, signs in (("k", tq.head_dim, tq.key_bits, tq._signs[0]), ("v", tq.value_dim, tq.value_bits, tq._signs[1])):
            y = None
            for i, b in tq._stages(total):
                part = tq._stage_values(p, i, b, dim, store=enc)
                y = part if y is None else y + part
            x = unrotate(y, signs)
            if p == "k":
                x = x + tq.key_mean.astype(mx.float32)
            out.append(x.astype(kb.dtype))
        return out
    def update_and_fetch(self, k, v):
        prev = self.offset
        K, V = super().update_and_fetch(k, v)
        n = max(0, (prev - 64) // 64 * 64)
        have = 0 if self.rk is None else self.rk.shape[2]
        if n > have:
            rk, rv = self._rec(K[:, :, have:n], V[:, :, have:n])
            self.rk = rk if self.rk is None else mx.concatenate([self.rk, rk], 2)
            self.rv = rv if self.rv is None else mx.concatenate([self.rv, rv], 2)
        if n == 0:
            return K, V
        rk, rv = self.rk, self.rv
        if self.sink:
            rk = mx.concatenate([K[:, :, :self.sink], rk[:, :, self.sink:]], 2)
            rv = mx.concatenate([V[:, :, :self.sink], rv[:, :, self.sink:]], 2)
        Kout = mx.concatenate([rk, K[:, :, n:]], 2) if self.kq else K
        Vout = mx.concatenate([rv, V[:, :, n:]], 2) if self.vq else V
        return Kout, Vout

class Plain4(TurboQuantRVQCache):
    @staticmethod
    def stage_bits(total):
        return total, 0

def make(cls=TurboQuantRVQCache, bits=4, group=None, **kw):
    def f(model):
        n = len(model.layers)
        out = []
        for i in range(n):
            tq = cls(KVCacheConfig(method="turboquant_rvq", bit_width_inlier=bits), i, n)
            if group: tq.max_group_size = group
            out.append(Sim(tq, **kw))
        return out
    return f

variants = {
    "as_is": make(),
    "keys_only_quantized": make(values=False),
    "values_only_quantized": make(keys=False),
    "first_token_exact": make(sink=1),
    "first_4_tokens_exact": make(sink=4),
    "no_key_centering": make(center=False),
    "uniform4_g64_no_sign_stage": make(cls=Plain4),
    "stage1_group32": make(group=32),
    "first_token_exact_no_centering": make(sink=1, center=False),
    "first_token_exact_mean_without_it": make(sink=1, mean_skip=1),
    "mean_without_first_token": make(mean_skip=1),
}
only = sys.argv[1:] or list(variants)
model, tok = load_smollm2(mx.float32)
tokens = passage_tokens(tok)
ref = reference_run(model, tokens)
for name in only:
    t = time.perf_counter()
    r = measure_kv_quality(model, tokens, variants[name], reference=ref).to_dict()
    print(json.dumps({"variant": name, "kl_mean": round(r["kl_mean"], 5), "top1": round(r["top1"], 4), "ppl": round(r["ppl"], 3), "ppl_ref": round(r["ppl_ref"], 3), "s": round(time.perf_counter() - t)}), flush=True)
