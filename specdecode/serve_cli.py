"""`specdecode serve ...`: the OpenAI-compatible server (on Ray Serve with `--replicas` and the other cluster
flags).

Example::

    specdecode serve --model qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct --port 8000
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import math
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
    _check_timeouts(args)
    if cluster_cli.wants_cluster(args):  # --replicas, --ray-address, --min/max-replicas: Ray Serve
        return cluster_cli.run_cluster(args)
    try:
        from specdecode.server.app import build_app
        from specdecode.server.process import ProcessExit, run_server
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
    process_exit = ProcessExit()  # a dead engine stops the server, which then exits with code 1
    app = build_app(llm, max_num_seqs=args.max_num_seqs, max_waiting=args.max_waiting,
                    served_model_name=args.served_model_name, api_key=args.api_key,
                    max_body_bytes=args.max_body_bytes, default_max_tokens=args.default_max_tokens,
                    request_timeout_s=args.request_timeout, stall_timeout_s=args.stall_timeout,
                    on_engine_death=process_exit)
    return run_server(app, args.host, args.port, args.log_level, args.drain_timeout, process_exit,
                      args.limit_concurrency or None)


def _check_timeouts(args: argparse.Namespace) -> None:
    """Finite and positive (the stall check may be 0: off); a bad value is refused before the model loads."""
    checks = {"request_timeout": (args.request_timeout, False), "stall_timeout": (args.stall_timeout, True),
              "drain_timeout": (args.drain_timeout, True)}
    for name, (value, zero_ok) in checks.items():
        if value is None:
            continue
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
            raise ValueError(f"--{name.replace('_', '-')} must be a finite number of seconds "
                             f"{'>= 0' if zero_ok else '> 0'}, got {value}")
