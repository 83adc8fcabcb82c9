"""Command line: `specdecode fetch|generate|chat|bench|serve|train-head ...`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import TYPE_CHECKING, Any

from specdecode.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_POOL_GB, METHODS, TARGET_QUANTIZATIONS
from specdecode.fetch import KNOWN_MODELS, FetchError
from specdecode.log import cli_logging, verbosity_level

if TYPE_CHECKING:
    from specdecode.engine.llm import LLM
    from specdecode.sampling import SamplingParams


def _add_model_args(p: argparse.ArgumentParser) -> None:
    from specdecode.hub import MODEL_ACTION, add_hub_args

    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", action=MODEL_ACTION,
                   help="target: alias, .gguf file, HF directory or HF id ORG/NAME[@REVISION][:FILE.gguf] "
                        "(default: %(default)s)")
    add_hub_args(p)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32", "fp16"], help="target precision")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--max-model-len", type=int, default=None, help="context to allocate (default 8192)")
    p.add_argument("--speculative-config", default=None,
                   help='JSON, e.g. \'{"method": "draft", "model": "qwen2.5-coder-0.5b-instruct", '
                        '"num_speculative_tokens": "auto"}\'')
    p.add_argument("--draft", default=None, help="shorthand for a draft-model speculative config")
    p.add_argument("--method", default=None, choices=list(METHODS), help="shorthand for the method")
    p.add_argument("--head", default=None, help='shorthand for an "eagle"/"medusa" config with this head directory')
    p.add_argument("--quantization", default="auto", choices=list(TARGET_QUANTIZATIONS),
                   help="target weight format: auto (default) runs a GGUF file's own blocks in bf16 on a CPU "
                        "with the GGUF kernels and keeps any other model as it is; none keeps the model's "
                        "weights (a GGUF's dequantized: the exact comparison); int8 (weight-only), "
                        "int8-dynamic (int8 weights and per-token int8 activations, the fastest verification "
                        "on CPU) and int4 change the model (speculation stays lossless relative to the "
                        "quantized target); gguf runs a GGUF file's own quantized blocks (AVX512-VNNI or AVX2 kernels)")
    p.add_argument("--num-speculative-tokens", default=None, help='k, or "auto" (default)')
    p.add_argument("--batch-invariant", action="store_true",
                   help="compute every token of the target's forwards as if alone (--dtype fp32): logits and "
                        "logprobs have the same bits with speculation on or off, in any batch, at the cost of "
                        "one pass over the weights per token")


def speculative_config_from_args(args: argparse.Namespace) -> dict[str, Any] | None:
    cfg: dict[str, Any] = {}
    if args.speculative_config:
        try:
            cfg = json.loads(args.speculative_config)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--speculative-config is not valid JSON: {exc}") from exc
        if not isinstance(cfg, dict):
            raise ValueError("--speculative-config must be a JSON object")
    if args.draft:
        cfg.setdefault("method", "draft")
        cfg["model"] = args.draft
    if getattr(args, "head", None):
        from specdecode.heads.persist import head_kind

        cfg.setdefault("method", head_kind(args.head))  # ours, a public EAGLE/Medusa checkpoint, or an HF id
        cfg["model"] = args.head
    if args.method:
        cfg["method"] = args.method
    if args.num_speculative_tokens is not None:
        k = args.num_speculative_tokens
        try:
            cfg["num_speculative_tokens"] = k if k == "auto" else int(k)
        except ValueError:
            raise ValueError(f"--num-speculative-tokens must be an integer or 'auto', got {k!r}") from None
    return cfg or None


def add_cache_args(p: argparse.ArgumentParser) -> None:
    """Prefix caching and chunked prefill (`LLM(enable_prefix_caching=, prefix_cache_gb=, max_num_batched_tokens=)`)."""
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="prefill every prompt in full (default: reuse the K/V of earlier prompts and answers that "
                        "start the same, e.g. a shared system prompt or the earlier turns of a chat)")
    p.add_argument("--prefix-cache-gb", type=float, default=DEFAULT_POOL_GB,
                   help="memory bound of the prefix cache's pool in GiB (default: %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
                   help="at most this many prompt tokens prefilled per step while other requests decode: a "
                        "longer prompt is prefilled in chunks between their steps, each costing about 1.5 of their "
                        "steps (measured); 0 = whole prompts at once (default: %(default)s)")


def cache_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {"enable_prefix_caching": not args.no_prefix_caching, "prefix_cache_gb": args.prefix_cache_gb,
            "max_num_batched_tokens": args.max_num_batched_tokens}


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=None,
                   help="cap on generated tokens (default: until EOS or the end of the context)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    """The sampling flags, checked before any model loads (`fit_to_context` sets the final max_tokens)."""
    from specdecode.sampling import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens if args.max_tokens is not None else 1, temperature=args.temperature,
        top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
        seed=args.seed, stop=tuple(args.stop), ignore_eos=getattr(args, "ignore_eos", False),
    )


def fit_to_context(params: SamplingParams, max_tokens: int | None, llm: LLM, prompt_tokens: int) -> SamplingParams:
    """`params` with max_tokens = `max_tokens`, or without it the rest of the context (until EOS, as llama.cpp)."""
    room = llm.max_model_len - prompt_tokens
    if room < 1:
        raise ValueError(f"the prompt ({prompt_tokens} tokens) fills the context length {llm.max_model_len}: "
                         "no room for output (raise --max-model-len)")
    return dataclasses.replace(params, max_tokens=max_tokens if max_tokens is not None else room)


def _add_verbosity_args(p: argparse.ArgumentParser, default: Any) -> None:
    group = p.add_mutually_exclusive_group()
    group.add_argument("-v", "--verbose", action="count", default=default,
                       help="also log quick steps with their times (DEBUG); long steps are logged by default "
                            "(serve: --log-level)")
    group.add_argument("-q", "--quiet", action="store_true", default=default, help="log warnings and errors only")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdecode", description="Speculative decoding inference engine")
    _add_verbosity_args(parser, default=None)
    sub = parser.add_subparsers(dest="command", required=True)

    f = sub.add_parser("fetch", help="download and verify a known model into the cache")
    f.add_argument("name", help=f"one of: {', '.join(KNOWN_MODELS)}")

    g = sub.add_parser("generate", help="generate text for one prompt")
    _add_model_args(g)
    g.add_argument("prompt", help="prompt text")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    _add_sampling_args(g)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")

    from specdecode.chat_cli import add_chat_parser

    add_chat_parser(sub)
    from specdecode.bench.cli import add_bench_parser

    add_bench_parser(sub)
    from specdecode.server.cli import add_serve_parser
    add_serve_parser(sub)
    from specdecode.heads.cli import add_train_head_parser

    add_train_head_parser(sub)
    for name, command in sub.choices.items():  # also after the command: `specdecode generate -v ...`
        if name != "serve":  # the server has --log-level
            _add_verbosity_args(command, default=argparse.SUPPRESS)
    return parser


def _generate(args: argparse.Namespace) -> int:
    from specdecode import LLM

    params = sampling_params_from_args(args)
    llm = LLM(args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
              speculative_config=speculative_config_from_args(args), quantization=args.quantization,
              batch_invariant=args.batch_invariant)
    if args.chat:
        prompt = llm.chat_prompt_ids([{"role": "user", "content": args.prompt}])
    else:
        prompt = llm.tokenizer.encode(args.prompt)
    params = fit_to_context(params, args.max_tokens, llm, len(prompt))
    seq = None
    for delta, current in llm.stream(prompt, params):
        seq = current
        if not args.json:
            sys.stdout.write(delta)
            sys.stdout.flush()
    assert seq is not None
    out = seq.to_output()
    m = out.metrics
    if args.json:
        stats_keys = ["prompt_tokens", "output_tokens", "seconds", "tokens_per_second", "prefill_seconds",
                      "steps", "draft_tokens", "accepted_tokens", "mean_accepted_length", "acceptance_rate",
                      "acceptance_by_position", "draft_seconds", "verify_seconds"]
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                          "stats": {k: m[k] for k in stats_keys}}))
    else:
        summary = (f"[{m['output_tokens']} tokens in {m['seconds']:.2f}s, {m['tokens_per_second']:.1f} tok/s, "
                   f"prefill {m['prefill_seconds']:.2f}s")
        if llm.spec is not None:
            summary += (f", {llm.spec.method}: {m['steps']} steps, mean accepted length "
                        f"{m['mean_accepted_length']:.2f}, acceptance {m['acceptance_rate']:.0%}")
            if m["draft_tokens"] == 0:  # the cost model kept k = 0: say so rather than look broken
                summary += " (nothing drafted: with the costs measured at start-up the cost model expected no gain)"
        print("\n" + summary + "]", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":  # the server configures logging itself (--log-level)
        return _run(args)
    with cli_logging(verbosity_level(args.verbose or 0, bool(args.quiet))):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    try:
        if args.command == "fetch":
            from specdecode.fetch import fetch_model

            print(fetch_model(args.name))
            return 0
        if args.command == "generate":
            return _generate(args)
        return args.func(args)
    except (ValueError, FetchError, MemoryError, OSError) as exc:
        # Bad input and environment problems are the user's to fix: a message, not a traceback.
        print(f"specdecode: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specdecode: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
