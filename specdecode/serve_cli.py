"""`specdecode serve ...`: the OpenAI-compatible server (on Ray Serve with `--replicas` and the other cluster
flags).

Example::

    specdecode serve --model qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct --port 8000
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import sys

from specdecode.cli_args import add_threads_arg, cache_kwargs, speculative_config_from_args
from specdecode.cluster import cli as cluster_cli
from specdecode.extras import missing_extra
from specdecode.server.serve_args import add_serve_subparser


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    s = add_serve_subparser(sub)
    add_threads_arg(s)  # this process's; each replica of a cluster has --replica-threads
    cluster_cli.add_cluster_args(s)
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
    if cluster_cli.wants_cluster(args):  # --replicas, --ray-address, --min/max-replicas: Ray Serve
        return cluster_cli.run_cluster(args)
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
