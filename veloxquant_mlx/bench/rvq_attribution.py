"""What limits turboquant_rvq's quality: the DESIGN.md protocol over variants of the cache that
change one part each.

    python -m veloxquant_mlx.bench.rvq_attribution --out results/x.json
    python -m veloxquant_mlx.bench.rvq_attribution --variants as_is,first_token_exact --bits 3

Every variant is a real TurboQuantRVQCache (cache/turboquant_rvq.py) with one setting changed,
read through the decoded K/V its `update_and_fetch` returns when no attention patch is
installed (the model runs mlx-lm's own attention over them). Its compressed-form attention
equals attention over those decoded K/V (tests/cache/test_turboquant_rvq.py,
test_compressed_attention_equals_attention_over_decoded), so each variant measures what that
cache would give, and variants the cache's attention cannot express (keys or values left exact)
run the same way. The variants (VARIANTS below):
- as_is: the cache without its exact attention sink (`exact_sink_tokens` = 0), i.e. as it was
  before commit 7194ad0 (results/bench_cpu.json: KL 0.0127, top-1 90.9%);
- first_token_exact: token 0 read back exactly, what the cache does now; first_4_tokens_exact;
- keys_only_quantized / values_only_quantized: the other half kept exact (no sink);
- no_key_centering: keys rotated without subtracting their per-channel mean;
- mean_without_first_token: the key mean taken over the first block without token 0;
- uniform4_g64_no_sign_stage: 4-bit uniform codes, group 64, instead of 3 bits + the sign stage;
- stage1_group32: stage-1 groups of 32 coordinates instead of 64;
- the combinations first_token_exact_no_centering and first_token_exact_mean_without_it.
Same protocol and options as veloxquant_mlx.bench.quality_split (the real SmolLM2 in float32,
512 tokens of Pride and Prejudice, prefill 128, decode teacher-forced, one shared reference):
KL and top-1 over all decoded rows and from `--from-row` on, PPL of the decoded part, bytes.
`--random-model tiny` is a plumbing smoke test (the JSON says so), not a quality figure.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field

from mlx_lm.models.cache import KVCache

from veloxquant_mlx.cache.turboquant_rvq import TurboQuantRVQCache

MODULE = "veloxquant_mlx.bench.rvq_attribution"


class UncenteredRVQCache(TurboQuantRVQCache):
    """Keys rotated and quantized as they come: a zero key mean."""

    def _encode(self, keys, values):
        import mlx.core as mx

        if self.key_mean is None:
            self.key_mean = mx.zeros((*keys.shape[:2], 1, keys.shape[3]), keys.dtype)
        return super()._encode(keys, values)


class MeanWithoutSinkRVQCache(TurboQuantRVQCache):
    """The key mean of the first encoded block taken without its first token."""

    def _encode(self, keys, values):
        import mlx.core as mx

        if self.key_mean is None:
            self.key_mean = mx.mean(keys[:, :, 1:].astype(mx.float32), axis=2,
                                    keepdims=True).astype(keys.dtype)
        return super()._encode(keys, values)


class UniformRVQCache(TurboQuantRVQCache):
    """All bits in the uniform stage, no sign stage (plain uniform codes after the rotation)."""

    @staticmethod
    def stage_bits(total: int) -> tuple[int, int]:
        return total, 0


class HalfExactCache(KVCache):
    """mlx-lm's KVCache returning the exact keys (or values) and the codec's decoded other half:
    what the codec costs on one side alone."""

    def __init__(self, codec: TurboQuantRVQCache, exact: str):
        super().__init__()
        self.codec, self.exact = codec, exact

    def update_and_fetch(self, keys, values):
        exact_k, exact_v = super().update_and_fetch(keys, values)
        decoded_k, decoded_v = self.codec.update_and_fetch(keys, values)
        return (exact_k, decoded_v) if self.exact == "keys" else (decoded_k, exact_v)

    @property
    def nbytes(self) -> int:
        # The codec's bytes: the exact copy exists only for the measurement.
        return self.codec.nbytes


@dataclass(frozen=True)
class Variant:
    """One changed setting of TurboQuantRVQCache, buildable per layer like a cache spec."""

    name: str
    label: str
    cls: type = TurboQuantRVQCache
    sink_tokens: int = 0  # exact_sink_tokens
    group_size: int | None = None  # max_group_size; None: the cache's
    exact: str | None = None  # "keys" or "values": that half left exact
    kind: str = "simulation"
    params: dict = field(default_factory=dict)  # the KVCacheConfig dict, set by with_bits

    def with_bits(self, bits: int) -> "Variant":
        from dataclasses import replace

        from veloxquant_mlx.config import KVCacheConfig

        config = KVCacheConfig(method="turboquant_rvq", bit_width_inlier=bits)
        return replace(self, params=config.to_dict())

    def make(self, layer_index: int = 0, n_layers: int = 1):
        from veloxquant_mlx.config import KVCacheConfig

        codec = self.cls(KVCacheConfig.from_dict(self.params), layer_index, n_layers)
        codec.exact_sink_tokens = self.sink_tokens
        if self.group_size is not None:
            codec.max_group_size = self.group_size
        return HalfExactCache(codec, self.exact) if self.exact else codec

    @contextlib.contextmanager
    def open(self, model):
        """Yield `make_cache() -> list` for `model`. No attention patch: the model attends over
        the decoded K/V (see the module docstring)."""
        n_layers = len(model.layers)
        yield lambda: [self.make(i, n_layers) for i in range(n_layers)]


VARIANTS = {v.name: v for v in (
    Variant("as_is", "turboquant_rvq without the exact sink (before 7194ad0)"),
    Variant("keys_only_quantized", "values exact, keys quantized", exact="values"),
    Variant("values_only_quantized", "keys exact, values quantized", exact="keys"),
    Variant("first_token_exact", "token 0 exact (the cache now)", sink_tokens=1),
    Variant("first_4_tokens_exact", "tokens 0-3 exact", sink_tokens=4),
    Variant("no_key_centering", "keys not centered", cls=UncenteredRVQCache),
    Variant("uniform4_g64_no_sign_stage", "all bits uniform g64, no sign stage", cls=UniformRVQCache),
    Variant("stage1_group32", "stage-1 groups of 32", group_size=32),
    Variant("first_token_exact_no_centering", "token 0 exact, keys not centered",
            cls=UncenteredRVQCache, sink_tokens=1),
    Variant("first_token_exact_mean_without_it", "token 0 exact, key mean without it",
            cls=MeanWithoutSinkRVQCache, sink_tokens=1),
    Variant("mean_without_first_token", "key mean without token 0", cls=MeanWithoutSinkRVQCache),
)}


def _variant_names(text: str) -> list[str]:
    import argparse

    names = list(VARIANTS) if text == "all" else [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in VARIANTS]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"--variants {text!r} is invalid: allowed is 'all' or a comma list of {', '.join(VARIANTS)}")
    return list(dict.fromkeys(names))


def parse_args(argv=None):
    from veloxquant_mlx.bench.command import parser
    from veloxquant_mlx.bench.quality_split import parse_protocol_args

    p = parser(MODULE, __doc__)
    p.add_argument("--variants", type=_variant_names, default=list(VARIANTS),
                   help="comma list of variants, or 'all' (default all)")
    p.add_argument("--bits", type=int, choices=(2, 3, 4), default=4,
                   help="bit_width_inlier: total bits per coordinate (default 4)")
    return parse_protocol_args(p, argv)


def main(argv=None) -> int:
    from veloxquant_mlx.bench import quality_split, report
    from veloxquant_mlx.bench.command import finish, start

    args = parse_args(argv)
    header = start(args)
    variants = [VARIANTS[n].with_bits(args.bits) for n in args.variants]
    try:
        model, tokens, info = quality_split.load(args)
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        print(f"{MODULE}: {exc}", file=sys.stderr)
        return 1
    result = {**header, "model": info, "dtype": args.dtype,
              "settings": {"tokens": len(tokens), "prefill": args.prefill, "from_row": args.from_row,
                           "bits": args.bits},
              "variants": [{"name": v.name, "label": v.label, "class": v.cls.__name__,
                            "exact_sink_tokens": v.sink_tokens, "group_size": v.group_size,
                            "exact": v.exact} for v in variants]}

    def save(rows):  # after every variant: a long run cut short keeps what it measured
        if args.out:
            report.write_json({**result, "results": rows}, args.out)

    result.update(quality_split.run(args, model, tokens, variants, on_row=save, label="rvq_attribution"))
    return finish(result, args.out)


if __name__ == "__main__":
    sys.exit(main())
