"""GEAR on synthetic K/V with outlier channels: attention error against fp16, next to
mx.quantize 2-bit g32 per token (mlx-lm's QuantizedKVCache layout) on the same data.

Run: /work/venv/bin/python benchmarks/gear_synthetic.py --out results/gear_synthetic.json

Data (per head, 1024 tokens, head_dim 64, fp16): keys N(0, 1) with 4 outlier channels (offset
+-8, spread x5), as in the pre-softmax keys of real LLMs (KIVI, KVQuant); values N(0, 1) with
0.2% spikes of +-10. 32 queries N(0, 1.5) per head, scale 1/8. Reported: relative L2 error of
the attention output, KL(ref || ours) of the attention weights, both averaged over heads/queries.
"""

from __future__ import annotations

import argparse
import json

import mlx.core as mx

from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.gear import GEARCache

H, T, D, Q = 4, 1024, 64, 32


class MagnitudeGEAR(GEARCache):
    """The paper's literal selection: largest |x| (distance from 0), for comparison."""

    def _selection_centres(self, blocks, per_channel):
        return mx.zeros_like(blocks)


def data(seed):
    k1, k2, k3, k4, k5 = mx.random.split(mx.random.key(seed), 5)
    keys = mx.random.normal((1, H, T, D), key=k1)
    channels = mx.random.permutation(D, key=k2)[:4]
    is_out = mx.zeros((D,)).at[channels].add(1.0) > 0
    keys = mx.where(is_out, keys * 5 + 8 * mx.sign(mx.random.normal((D,), key=k5)), keys)
    values = mx.random.normal((1, H, T, D), key=k3)
    spikes = mx.random.uniform(shape=values.shape, key=k4) < 0.002
    values = mx.where(spikes, 10 * mx.sign(values), values)
    q = 1.5 * mx.random.normal((1, H, Q, D), key=mx.random.key(seed + 99))
    return keys.astype(mx.float16), values.astype(mx.float16), q


def attention_probs(q, k):
    return mx.softmax((q * 0.125) @ k.astype(mx.float32).swapaxes(-1, -2), axis=-1)


def metrics(q, k, v, k_hat, v_hat):
    p, p_hat = attention_probs(q, k), attention_probs(q, k_hat)
    out, out_hat = p @ v.astype(mx.float32), p_hat @ v_hat.astype(mx.float32)
    rel = (mx.linalg.norm(out_hat - out, axis=-1) / mx.linalg.norm(out, axis=-1)).mean().item()
    kl = mx.sum(p * (mx.log(p + 1e-30) - mx.log(p_hat + 1e-30)), axis=-1).mean().item()
    return {"attention_output_rel_error": rel, "attention_kl": kl}


def gear_run(cls, q, k, v, **fields):
    cache = cls(KVCacheConfig(method="gear", **fields))
    cache.update_and_fetch(k, v)
    cache._flush()
    k_hat, v_hat = cache.decode_float32()
    # The same figure through the compressed-form attention: the Q queries of a head are
    # folded in as Q query heads sharing its KV head (one decode position, no causal cut).
    out = cache.attention(q.reshape(1, H * Q, 1, D), 0.125).reshape(1, H, Q, D)
    ref = mx.softmax((q * 0.125) @ k_hat.swapaxes(-1, -2), axis=-1) @ v_hat
    assert mx.allclose(out, ref, atol=1e-3).item()
    result = metrics(q, k, v, k_hat, v_hat)
    result["bits_per_element"] = cache.bits_per_element()
    result["measured_bits_per_element"] = 8 * cache.nbytes / (2 * k.size)
    return result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--out", default="results/gear_synthetic.json")
    args = ap.parse_args()
    variants = {
        "gear-2 (r4, 1% outliers, group-mean selection)": (GEARCache, {}),
        "gear-2 magnitude selection (paper literal)": (MagnitudeGEAR, {}),
        "gear-2 rank 0 (quant + outliers)": (GEARCache, {"gear_rank": 0}),
        "gear-2 no outliers (quant + low-rank)": (GEARCache, {"gear_outlier_fraction": 0.0}),
        "gear-2 quant only (KIVI-2 grouping)": (GEARCache, {"gear_rank": 0, "gear_outlier_fraction": 0.0}),
        "gear-2 r8 2% outliers": (GEARCache, {"gear_rank": 8, "gear_outlier_fraction": 0.02}),
        "gear-4": (GEARCache, {"gear_bits": 4}),
    }
    totals: dict[str, dict[str, float]] = {}
    for seed in range(args.seeds):
        k, v, q = data(seed)
        rows = {}
        deq = [mx.dequantize(*mx.quantize(x, group_size=32, bits=2), group_size=32, bits=2) for x in (k, v)]
        rows["mx.quantize 2-bit g32 per token (mlx-lm QuantizedKVCache)"] = dict(
            metrics(q, k, v, *deq), bits_per_element=3.0, measured_bits_per_element=3.0
        )
        for name, (cls, fields) in variants.items():
            rows[name] = gear_run(cls, q, k, v, **fields)
        for name, row in rows.items():
            acc = totals.setdefault(name, {})
            for key, value in row.items():
                acc[key] = acc.get(key, 0.0) + value / args.seeds
    result = {
        "command": f"/work/venv/bin/python benchmarks/gear_synthetic.py --seeds {args.seeds} --out {args.out}",
        "data": __doc__.split("Data ")[1].split("Reported")[0].strip(),
        "mean_over_seeds": totals,
    }
    print(json.dumps(result, indent=2))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
