"""`specdecode generate`: one prompt, its answer streamed to stdout (or one JSON object with `--json`)."""

from __future__ import annotations

import argparse
import json
import sys

from specdecode.cli_args import (
    add_model_args,
    add_sampling_args,
    add_threads_arg,
    fit_to_context,
    sampling_params_from_args,
    speculative_config_from_args,
)

STATS_KEYS = ["prompt_tokens", "output_tokens", "seconds", "tokens_per_second", "prefill_seconds", "steps",
              "draft_tokens", "accepted_tokens", "mean_accepted_length", "acceptance_rate", "acceptance_by_position",
              "draft_seconds", "verify_seconds"]
"""The metrics `--json` reports."""


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("generate", help="generate text for one prompt")
    add_model_args(g)
    add_threads_arg(g)
    g.add_argument("prompt", help="prompt text")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_sampling_args(g)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    g.set_defaults(func=run_generate_command)


def run_generate_command(args: argparse.Namespace) -> int:
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
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                          "stats": {k: m[k] for k in STATS_KEYS}}))
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
