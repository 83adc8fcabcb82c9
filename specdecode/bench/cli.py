"""`specdecode bench ...`: Spec-Bench-style benchmark of our methods and of peer engines.

Example::

    specdecode bench --model qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct \\
        --methods plain,ngram,draft,draft-k4 --dataset spec_bench --per-task 5 --max-tokens 128 \\
        --peers transformers,llama.cpp --out bench-out/spec_bench
"""

from __future__ import annotations

import argparse
import importlib.util
import shlex
import sys
from pathlib import Path

from specdecode.bench.datasets import DATASETS
from specdecode.bench.methods import METHOD_HELP
from specdecode.cli_args import add_threads_arg


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser(
        "bench", help="benchmark methods (and peer engines) on an evaluation set",
        description="Spec-Bench protocol: batch 1, greedy by default, one warm-up per method excluded, prefill "
                    "included in each prompt's time; speedup = ratio of mean tokens/s vs plain in the same run.",
    )
    b.add_argument("--model", default="qwen2.5-coder-1.5b-instruct",
                   help="target: alias, .gguf file or HF directory (default: %(default)s)")
    b.add_argument("--methods", type=_csv, default=None,
                   help="comma list of methods: " + METHOD_HELP + " (default: plain,ngram,draft with --draft, "
                        "else plain,ngram)")
    b.add_argument("--draft", type=_csv, default=[],
                   help="draft model for draft methods and transformers' assisted generation (alias, .gguf or HF "
                        "directory); more, as LABEL=MODEL, for methods like draft:LABEL, to compare drafts in one "
                        "run (comma list)")
    b.add_argument("--compare-table", action="store_true",
                   help="the field's comparison table on the Qwen pair: methods plain,ngram,draft,eagle (+ medusa "
                        "with a Medusa --head), --draft qwen2.5-coder-0.5b-instruct unless given; see summary.md")
    b.add_argument("--head", type=_csv, default=[],
                   help="trained head directories for the eagle/medusa methods (comma list; the kind is read from "
                        "each head's config; default: the head shipped for the target, if any); LABEL=DIR names "
                        "a head for methods like eagle:LABEL, to compare heads in one run")
    b.add_argument("--dataset", default="spec_bench",
                   help=f"one of {', '.join(DATASETS)}, several joined with + (spec_bench+humaneval), or a path "
                        "to a .jsonl file (default: %(default)s)")
    b.add_argument("--tasks", type=_csv, default=None, help="comma list of tasks (or categories) to keep")
    b.add_argument("--per-task", default=None,
                   help="first N prompts of each task; N,TASK=M gives TASK its own count (e.g. 10,code=40)")
    b.add_argument("--limit", type=int, default=None, help="first N prompts overall (after --per-task)")
    b.add_argument("--max-tokens", type=int, default=128, help="max new tokens per prompt (default: %(default)s)")
    b.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--dtype", default="bf16", choices=["bf16", "fp32", "fp16"], help="target precision")
    b.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    b.add_argument("--max-model-len", type=int, default=None, help="context to allocate (default 8192)")
    add_threads_arg(b)  # the peers run on as many (recorded in summary.json's machine.torch_threads)
    b.add_argument("--peers", type=_csv, default=[],
                   help="comma list of peer engines: transformers, llama.cpp (each skipped with a note if its "
                        "package is missing)")
    b.add_argument("--bandwidth-gb", type=float, default=1.0,
                   help="size of the memory-bandwidth probe for the memory floor; 0 skips it (default: %(default)s)")
    b.add_argument("--no-memory-floor", dest="bandwidth_gb", action="store_const", const=0.0,
                   help="skip the bandwidth probe and the memory-floor note (same as --bandwidth-gb 0)")
    b.add_argument("--flat-verify-cost", action="store_true",
                   help="size our methods' k and trees as if verifying a full tree cost one forward (a GPU): "
                        "shows the τ such hardware would get; tokens/s remain this machine's")
    b.add_argument("--no-warmup", action="store_true", help="do not run the warm-up generation per method")
    b.add_argument("--no-peak-rss-alone", action="store_true",
                   help="skip the child process per plain engine (ours, llama.cpp's) that measures its peak RSS alone")
    b.add_argument("--no-plots", action="store_true")
    b.add_argument("--no-progress", action="store_true")
    b.add_argument("--peer-methods", type=_csv, default=None,
                   help="keep only these peer methods (e.g. hf-plain,hf-assisted,hf-prompt-lookup,llamacpp-plain)")
    b.add_argument("--round-size", type=int, default=None,
                   help="run every method on N prompts before the next N (an interrupted run loses little and "
                        "each round is measured close in time; default: all prompts in one round)")
    b.add_argument("--resume", action="store_true",
                   help="continue the run stored in --out (same settings), skipping what it already measured")
    b.add_argument("--redo", type=_csv, default=[],
                   help="with --resume: measure these methods again (their stored records are dropped)")
    b.add_argument("--report-only", action="store_true",
                   help="with --resume: write summary.md, summary.json and the plots from the records so far "
                        "(a run still in progress, or stopped), measuring nothing")
    b.add_argument("--out", type=Path, required=True, help="output directory")
    b.set_defaults(func=run_bench_command)


def run_bench_command(args: argparse.Namespace) -> int:
    from specdecode.bench.datasets import parse_per_task
    from specdecode.bench.harness import run_bench
    from specdecode.bench.run_config import BenchConfig

    for name in ("limit", "max_tokens"):  # --round-size is checked by the harness
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    heads = _heads_by_kind(args.head, args.model)
    args.drafts, args.draft = args.draft, _drafts_by_label(args.draft, heads)
    if args.compare_table:
        args.draft = args.draft or COMPARE_DRAFT
        args.methods = args.methods or ["plain", "ngram", "draft", *[k for k in ("eagle", "medusa") if k in heads]]
    if args.methods is None:
        args.methods = ["plain", "ngram", "draft"] if args.draft else ["plain", "ngram"]
    cfg = BenchConfig(
        model=args.model, methods=args.methods, out=args.out, draft=args.draft, dataset=args.dataset,
        tasks=args.tasks, per_task=parse_per_task(args.per_task) if args.per_task else None, limit=args.limit,
        max_tokens=args.max_tokens,
        temperature=args.temperature, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
        peers=args.peers, seed=args.seed, warmup=not args.no_warmup, bandwidth_gb=args.bandwidth_gb,
        plots=not args.no_plots, progress=not args.no_progress, heads=heads, round_size=args.round_size,
        flat_verify_cost=args.flat_verify_cost, peak_rss_alone=not args.no_peak_rss_alone,
        resume=args.resume, peer_methods=args.peer_methods, redo=args.redo, report_only=args.report_only,
    )
    if (args.redo or args.report_only) and not args.resume:
        raise ValueError("--redo and --report-only need --resume (they act on a stored run)")
    summary = run_bench(cfg, _command_line(args))
    print(_short_table(summary))
    plotted = not args.no_plots and importlib.util.find_spec("matplotlib") is not None
    print(f"wrote {args.out}/summary.md, summary.json, records.jsonl{' and plots' if plotted else ''}", file=sys.stderr)
    return 0


COMPARE_DRAFT = "qwen2.5-coder-0.5b-instruct"


def _drafts_by_label(entries: list[str], heads: dict[str, str]) -> str | None:
    """The unlabelled draft model (None without one); each LABEL=MODEL goes into `heads` as draft:LABEL."""
    plain = None
    for entry in entries:
        label, _, model = entry.rpartition("=")
        if label:
            heads[f"draft:{label}"] = model
        elif plain is not None:
            raise ValueError(f"--draft names two unlabelled drafts ({plain}, {model}); label the others LABEL=MODEL")
        else:
            plain = model
    return plain


def _heads_by_kind(paths: list[str], target: str) -> dict[str, str]:
    from specdecode.heads.persist import read_head_config
    from specdecode.heads.shipped import shipped_heads

    heads = shipped_heads(target)
    for entry in paths:
        label, _, path = entry.rpartition("=")  # LABEL=DIR names a head for methods like eagle:LABEL
        kind = read_head_config(Path(path).expanduser()).kind
        heads[f"{kind}:{label}" if label else kind] = path
    return heads


def _command_line(args: argparse.Namespace) -> str:
    """The command as typed when run from a shell; otherwise rebuilt from the parsed arguments."""
    if sys.argv[1:2] == ["bench"]:
        return "specdecode " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    parts = ["specdecode", "bench", "--model", args.model, "--methods", ",".join(args.methods)]
    optional = {"--draft": ",".join(args.drafts) if args.drafts else None,
                "--head": ",".join(args.head) if args.head else None, "--dataset": args.dataset,
                "--tasks": ",".join(args.tasks) if args.tasks else None, "--per-task": args.per_task,
                "--limit": args.limit, "--max-tokens": args.max_tokens, "--temperature": args.temperature,
                "--seed": args.seed, "--dtype": args.dtype, "--device": args.device,
                "--max-model-len": args.max_model_len, "--threads": args.threads,
                "--peers": ",".join(args.peers) if args.peers else None,
                "--bandwidth-gb": args.bandwidth_gb,
                "--peer-methods": ",".join(args.peer_methods) if args.peer_methods else None,
                "--round-size": args.round_size, "--redo": ",".join(args.redo) if args.redo else None}
    for flag, value in optional.items():
        if value is not None:
            parts += [flag, str(value)]
    for flag in ("compare_table", "no_warmup", "no_peak_rss_alone", "no_plots", "no_progress", "resume"):
        if getattr(args, flag):
            parts.append("--" + flag.replace("_", "-"))
    parts += ["--out", str(args.out)]
    return " ".join(shlex.quote(p) for p in parts)


def _short_table(summary: dict) -> str:
    lines = [f"{'method':<24} {'tok/s':>8} {'speedup':>8} {'tau':>6} {'accept':>7} {'identical':>9}"]
    for method in summary["methods"]:
        s = summary["by_method"][method]["overall"]

        def f(v: float | None, fmt: str) -> str:
            return format(v, fmt) if v is not None else "-"

        lines.append(f"{method:<24} {f(s['tokens_per_second'], '8.2f')} {f(s['speedup'], '8.2f')} "
                     f"{f(s['mean_accepted_length'], '6.2f')} {f(s['acceptance_rate'], '7.0%')} "
                     f"{f(s['identical_rate'], '9.0%')}")
    return "\n".join(lines)
