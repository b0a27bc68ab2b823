"""Command line: ``python -m torch_kernels doctor`` | ``demo`` | ``serve`` | ``goodput`` | ``bench [args]``
(``bench compare`` and ``bench bisect`` read the benchmark history back)."""

from __future__ import annotations

import argparse
import pathlib
import runpy
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_kernels")
    sub = parser.add_subparsers(dest="command", required=True)
    doctor = sub.add_parser("doctor", help="list the backends that run here and check every op on each")
    doctor.add_argument("--device", default="cpu",
                        help="where the inputs live: cpu, or cuda (the compiled Triton kernels and the reference)")
    doctor.add_argument("--backends", default=None, help="comma-separated backends to check (default: all that run)")
    doctor.add_argument("--dtypes", default="float32,float16,bfloat16", help="comma-separated input dtypes")
    sub.add_parser("demo", help="out-of-distribution scoring of synthetic features on each backend")
    serve = sub.add_parser("serve", help="chat with SmolLM2 through the paged-attention serving loop")
    serve.add_argument("--backend", default=None, help="backend of the attention ops (default: by device)")
    serve.add_argument("--max-new-tokens", type=int, default=48)
    goodput = sub.add_parser("goodput", help="an OOD gate in the serving loop: CLINC150 prompts to SmolLM2, tokens "
                                              "saved and AUROC (Markdown, JSON, PNG)")
    size = goodput.add_mutually_exclusive_group()
    size.add_argument("--smoke", dest="mode", action="store_const", const="smoke", help="tiny, for CI")
    size.add_argument("--full", dest="mode", action="store_const", const="full", help="all of CLINC150")
    goodput.set_defaults(mode="default")
    goodput.add_argument("--out", type=pathlib.Path, default=None,
                         help="output folder (default: benchmarks/results of a source checkout, else .)")
    goodput.add_argument("--layer", type=int, nargs="+", default=None,
                         help="hidden states the gate reads, one or several (default: torch_kernels.goodput.RECIPE's)")
    goodput.add_argument("--pooling", choices=("mean", "last"), default=None,
                         help="over the prompt's tokens (default: torch_kernels.goodput.RECIPE's)")
    goodput.add_argument("--span", choices=("prefix", "template", "sink", "all"), default=None,
                         help="positions pooled: all but the chat template's prefix, all but its prefix and "
                              "suffix, all but the first, or all "
                              "(default: torch_kernels.goodput.RECIPE's)")
    goodput.add_argument("--transform", default=None,
                         help="per-channel transform, one of torch_kernels.ood.recipes.TRANSFORMS "
                              "(default: torch_kernels.goodput.RECIPE's)")
    goodput.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    bench = sub.add_parser("bench", help="run the benchmarks (from a source checkout); bench compare | bisect | "
                                          "false-alarms read their history back (benchmarks/history.py)")
    bench.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)

    if args.command == "doctor":
        import torch

        from .selftest import doctor

        if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
            print("doctor: --device cuda, but torch.cuda.is_available() is False here", file=sys.stderr)
            return 2
        dtypes = tuple(getattr(torch, name.strip()) for name in args.dtypes.split(","))
        names = None if args.backends is None else tuple(b.strip() for b in args.backends.split(","))
        return 0 if doctor(dtypes, device=args.device, backend_names=names) else 1
    if args.command == "demo":
        return demo()
    if args.command == "serve":
        return serve_demo(args.backend, args.max_new_tokens)
    if args.command == "goodput":
        from . import goodput

        layer = None if args.layer is None else tuple(args.layer)
        return goodput.main(args.mode, args.out, layer, args.pooling, args.threads, args.span, args.transform)
    runner = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "run.py"
    if not runner.exists():
        print(f"bench: {runner} not found; the benchmarks ship with the source checkout", file=sys.stderr)
        return 2
    sys.argv = [str(runner), *args.args]
    runpy.run_path(str(runner), run_name="__main__")
    return 0


def auroc(negatives, positives) -> float:
    """Probability that a positive outscores a negative (ties count half), by ranks."""
    import torch

    scores = torch.cat([negatives, positives]).double()
    ranks = torch.empty_like(scores)
    ranks[scores.argsort()] = torch.arange(1, len(scores) + 1, dtype=torch.float64)
    n, p = len(negatives), len(positives)
    return ((ranks[n:].sum() - p * (p + 1) / 2) / (n * p)).item()


def demo() -> int:
    """Fit on in-distribution features, then tell them apart from shifted ones on each backend."""
    import torch

    from . import available_backends
    from .ood import MahalanobisScorer

    gen = torch.Generator().manual_seed(0)
    d = 64
    mix = torch.randn(d, d, generator=gen) / d**0.5 + torch.eye(d)
    inside = lambda n: torch.randn(n, d, generator=gen) @ mix  # noqa: E731
    scorer = MahalanobisScorer("ledoit_wolf").fit(inside(5000))
    heldout, queries = inside(1000), inside(1000)
    outside = queries + 0.25 * torch.randn(1, d, generator=gen)  # the same features, shifted
    limit = scorer.threshold(heldout, tpr=0.95)
    print(f"fitted on 5000 x {d} features (shrinkage {scorer.shrinkage_.item():.3f}); threshold at 95% TPR {limit:.1f}")
    print(f"{'backend':<10} {'AUROC':>7} {'FPR@95%TPR':>11}")
    for backend in available_backends():
        s_in, s_out = scorer.score(queries, implementation=backend), scorer.score(outside, implementation=backend)
        print(f"{backend:<10} {auroc(s_in, s_out):>7.3f} {(s_out <= limit).float().mean().item():>11.3f}")
    return 0


def serve_demo(backend, max_new_tokens: int) -> int:
    """Three chat prompts served together by the continuous-batching loop of torch_kernels.serving."""
    import time

    from . import models
    from .serving import Engine

    if (reason := models.missing_reason()) is not None:
        print(f"serve: {reason}", file=sys.stderr)
        return 2
    model, tokenizer = models.load_smollm2()
    questions = ["What is the capital of France?", "Write a haiku about paged attention.",
                 "Give three tips for writing clear code."]
    prompts = [models.chat_prompt(tokenizer, q) for q in questions]
    engine = Engine(model, num_blocks=64, block_size=16, max_batched_tokens=32, implementation=backend)
    start = time.perf_counter()
    outputs = engine.generate(prompts, max_new_tokens)
    seconds = time.perf_counter() - start
    for question, output in zip(questions, outputs):
        print(f"> {question}\n{tokenizer.decode(output, skip_special_tokens=True).strip()}\n")
    mixed = sum(1 for s in engine.stats if s.prefill_tokens and s.decode_tokens)
    print(f"{sum(map(len, outputs))} tokens in {len(engine.stats)} steps ({mixed} mixing prefill and decode), "
          f"{seconds:.1f} s, attention on {backend or 'the device default'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
