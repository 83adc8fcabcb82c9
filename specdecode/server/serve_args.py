"""The `serve` subcommand's flags, shared by `specdecode serve` and `python -m specdecode.cluster` (the same
server on Ray Serve); each adds the cluster's own flags after these."""

from __future__ import annotations

import argparse
import os

from specdecode.cli_args import add_cache_args, add_model_args

LIMIT_CONCURRENCY = 1024


def _count(text: str) -> int:
    """A count >= 0 (argparse type)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def add_serve_subparser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """The `serve` subcommand with the server's flags (the caller adds the cluster's and sets what runs it)."""
    s = sub.add_parser(
        "serve", help="serve the OpenAI-compatible API (completions, chat completions, /metrics)",
        description="OpenAI-compatible HTTP server with continuous batching and speculative decoding. Binds "
                    "loopback by default; with --api-key every endpoint but /health needs "
                    "'Authorization: Bearer KEY'.",
    )
    add_model_args(s)
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
    s.add_argument("--limit-concurrency", type=_count, default=LIMIT_CONCURRENCY, metavar="N",
                   help="connections (and requests in progress) the HTTP server holds at once; beyond it uvicorn "
                        "answers 503 at once, before any parsing; 0 = no limit (default: %(default)s; with "
                        "--replicas, --max-queued-requests bounds the cluster instead)")
    s.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                   help="the longest a request may take, queueing included; past it a 408 (a stream: an error "
                        "event), its row freed. A request's own 'timeout' field may only shorten it "
                        "(default: no limit)")
    s.add_argument("--stall-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="/health answers 503 once one engine step has run this long, so that a supervisor "
                        "restarts the server; 0 = never (default: %(default)s)")
    s.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM, /health and new requests get a 503 while the requests in flight get this "
                        "long to finish (then they fail); then the server exits 0 (default: %(default)s)")
    s.add_argument("--seed", type=int, default=0, help="seed of requests that give none")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return s
