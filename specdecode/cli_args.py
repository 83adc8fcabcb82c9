"""The flags several subcommands share (`generate`, `chat`, `serve`, `python -m specdecode.cluster`) and the
helpers that turn them into `LLM` and `SamplingParams` arguments.

A leaf of the command line: it imports no subcommand module, so every subcommand may import it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from typing import TYPE_CHECKING, Any

from specdecode.config import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_POOL_GB,
    METHODS,
    SUFFIX_SCOPES,
    TARGET_QUANTIZATIONS,
)
from specdecode.hub import HubRef, parse_hub_id

if TYPE_CHECKING:
    from specdecode.engine.llm import LLM
    from specdecode.sampling import SamplingParams


class _ModelPart(argparse.Action):
    """--model, --revision and --gguf-file in any order compose one model name (`ORG/NAME@REV:FILE.gguf`)."""

    def __call__(self, parser: argparse.ArgumentParser, ns: argparse.Namespace, value: Any,
                 option: str | None = None) -> None:
        if self.dest == "model":
            ns._model_base = value
            ns._model_given = True
        else:
            ns.__dict__.setdefault("_model_base", ns.model)
            setattr(ns, self.dest, value)
        rev, gguf_file = getattr(ns, "revision", None), getattr(ns, "gguf_file", None)
        base = ns._model_base
        ref = parse_hub_id(base)
        if (rev or gguf_file) and (ref is None or (ref.revision and rev) or (ref.gguf_file and gguf_file)):
            if getattr(ns, "_model_given", False):
                parser.error(f"--revision/--gguf-file need --model ORG/NAME (a Hugging Face id without @REVISION "
                             f"or :FILE.gguf of its own), got {base!r}")
            return  # --model comes later (or never: the default alias)
        if ref is not None and (rev or gguf_file):
            ns.model = str(HubRef(ref.repo, rev or ref.revision, gguf_file or ref.gguf_file))
        else:
            ns.model = base


def physical_cores() -> int:
    """The CPU's physical cores, else its logical ones: a core's hyper-threads share its arithmetic units, so more
    compute threads than cores only add contention."""
    import psutil

    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


def default_threads() -> int:
    """`--threads` when not given: $OMP_NUM_THREADS where it is set (the knob torch and OpenMP already honour),
    else the physical cores."""
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(env) if env.isdigit() and int(env) > 0 else physical_cores()


def _thread_count(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def add_threads_arg(p: argparse.ArgumentParser) -> None:
    """`--threads N`, for every command that runs a model (`cli` applies it before the command runs)."""
    p.add_argument("--threads", type=_thread_count, default=None, metavar="N",
                   help="CPU threads of torch and of the native kernels (default: $OMP_NUM_THREADS if set, "
                        "else the physical cores)")


def apply_threads(threads: int | None) -> int:
    """Set the compute threads: torch's intra-op pool, whose count the C kernels also take for their OpenMP
    regions (`torch.get_num_threads()` at each call), so one setting covers both. Returns the count."""
    import torch

    n = threads or default_threads()
    torch.set_num_threads(n)
    return n


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The target, its precision and format, and the speculative config's shorthands."""
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", action=_ModelPart,
                   help="target: alias, .gguf file, HF directory or HF id ORG/NAME[@REVISION][:FILE.gguf|:QUANT] "
                        "(default: %(default)s)")
    p.add_argument("--revision", default=None, action=_ModelPart,
                   help="Hugging Face id only: branch, tag or commit of --model (same as ORG/NAME@REVISION)")
    p.add_argument("--gguf-file", default=None, action=_ModelPart,
                   help="Hugging Face id only: the repo's .gguf file, or a quantization tag such as Q4_K_M (same as "
                        "ORG/NAME:FILE.gguf, ORG/NAME:Q4_K_M)")
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
    p.add_argument("--suffix-scope", default=None, choices=list(SUFFIX_SCOPES),
                   help="whose earlier answers the suffix lookups (the suffix method, every drafter's lookup guess) "
                        "draft from: global (every request of this server; the default), key (requests with the "
                        "same cache_salt), request (none: each request's own text)")
    p.add_argument("--suffix-cache-tokens", type=int, default=None,
                   help="tokens of earlier answers kept for suffix lookups, oldest evicted first, at most about "
                        "1 KB each (default 131072)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="on torch's fallback kernels (no AVX512-BF16), compute every token of the target's "
                        "forwards as if alone (--dtype fp32), at one pass over the weights per token; our kernels "
                        "give every token the same bits in any batch by default")


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
    for name in ("suffix_scope", "suffix_cache_tokens"):  # they tune a speculative config; alone they make none
        if cfg and getattr(args, name, None) is not None:
            cfg[name] = getattr(args, name)
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


def add_sampling_args(p: argparse.ArgumentParser) -> None:
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
