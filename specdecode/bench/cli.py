"""`specdecode bench ...` sub-command registration (the harness lives beside it)."""

from __future__ import annotations

import argparse


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench", help="benchmarks (see benchmarks/ and BENCHMARKS.md)")
    b.set_defaults(func=lambda args: (print("bench: not implemented yet"), 1)[1])
