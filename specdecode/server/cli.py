"""`specdecode serve ...`: the OpenAI-compatible server.

Example::

    specdecode serve --model qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct --port 8000
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys

from specdecode.cli import _add_model_args, add_cache_args, cache_kwargs, speculative_config_from_args
from specdecode.extras import missing_extra


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser(
        "serve", help="serve the OpenAI-compatible API (completions, chat completions, /metrics)",
        description="OpenAI-compatible HTTP server with continuous batching and speculative decoding. Binds "
                    "loopback by default; with --api-key every endpoint but /health needs "
                    "'Authorization: Bearer KEY'.",
    )
    _add_model_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s, loopback only)")
    s.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    s.add_argument("--max-num-seqs", type=int, default=8, help="running batch size (default: %(default)s)")
    add_cache_args(s)
    s.add_argument("--max-waiting", type=int, default=64,
                   help="requests that may wait for a free row; beyond it, 429 (default: %(default)s)")
    s.add_argument("--api-key", default=os.environ.get("SPECDECODE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $SPECDECODE_API_KEY, else none)")
    s.add_argument("--served-model-name", default=None,
                   help="model id for clients and /v1/models (default: the --model value)")
    s.add_argument("--default-max-tokens", type=int, default=256,
                   help="max_tokens of a request that gives none: min(this, remaining context) "
                        "(default: %(default)s)")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20,
                   help="larger request bodies get a 413 (default: %(default)s)")
    s.add_argument("--seed", type=int, default=0, help="seed of requests that give none")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    from specdecode.cluster.cli import add_cluster_args

    add_cluster_args(s)
    s.set_defaults(func=run_serve_command)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run_serve_command(args: argparse.Namespace) -> int:
    for name in ("max_num_seqs", "max_waiting", "default_max_tokens", "max_body_bytes"):
        value = getattr(args, name)
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    from specdecode.cluster.cli import run_cluster, wants_cluster

    if wants_cluster(args):  # --replicas, --ray-address, --min/max-replicas: Ray Serve
        return run_cluster(args)
    try:
        import uvicorn

        from specdecode.server.app import build_app
    except ImportError as exc:
        raise ValueError(f"specdecode serve: {missing_extra('serve', exc)}") from None
    from specdecode import LLM

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not _is_loopback(args.host) and not args.api_key:
        print(f"specdecode: warning: binding {args.host} without --api-key: anyone who can reach it may use it",
              file=sys.stderr)
    llm = LLM(args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
              speculative_config=speculative_config_from_args(args), seed=args.seed, quantization=args.quantization,
              max_num_seqs=args.max_num_seqs, batch_invariant=args.batch_invariant,
              **cache_kwargs(args))  # the measurement covers the server's batch
    app = build_app(llm, max_num_seqs=args.max_num_seqs, max_waiting=args.max_waiting,
                    served_model_name=args.served_model_name, api_key=args.api_key,
                    max_body_bytes=args.max_body_bytes, default_max_tokens=args.default_max_tokens)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    return 0
