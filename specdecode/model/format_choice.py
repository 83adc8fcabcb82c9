"""Which linear format a small drafter (an EAGLE or Medusa head) runs fastest in on this machine, measured at load.

Below AVX512-BF16 a head's one-token forwards can take weight-only int8 (half the bytes, more arithmetic per
weight), bf16 (the AVX2 GEMM) or Q8_0 blocks on the GGUF kernels (int8 weights and int8 activations: VNNI's
integer dot products where the CPU has them); which wins depends on the machine's memory bandwidth against its
FMA and integer rates, so the choice is timed rather than assumed: each of the head's linears at one row and at a
tree level's rows, every format, alternated.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch
from torch import nn

from specdecode.model import gguf_linear
from specdecode.model.fast_linear import LinearFormat, make_linear

ROUNDS = 5


def head_formats_below_bf16() -> tuple[LinearFormat, ...]:
    """The formats a head is timed in below AVX512-BF16: Q8_0 joins where a vector GGUF kernel runs."""
    vector = gguf_linear.isa() not in (None, "scalar")
    return ("int8", "bf16", "q8_0") if vector else ("int8", "bf16")


ROWS = (1, 8)
"""Rows per timed forward: a chain's draft step, and a tree level's (a head drafts trees a few nodes wide)."""


def forward_seconds(modules: Iterable[nn.Module], widths: list[int], rounds: int = ROUNDS,
                    clock: Callable[[], float] = time.perf_counter) -> float:
    """Best-of-rounds seconds of a [rows, K] forward through every module (K from `widths`) for each of ROWS."""
    modules = list(modules)
    xs = [torch.randn(rows, k).to(torch.bfloat16) for rows in ROWS for k in widths]
    modules = modules * len(ROWS)
    best = float("inf")
    with torch.inference_mode():
        for _ in range(rounds):
            start = clock()
            for module, x in zip(modules, xs, strict=True):
                module(x)
            best = min(best, clock() - start)
    return best


def fastest_format(model: nn.Module, candidates: tuple[LinearFormat, ...]) -> LinearFormat:
    """The candidate format whose few-row forwards through the model's nn.Linear layers take least time here
    (the model is not changed; each format converts copies of its linears)."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if len(candidates) < 2 or not linears:
        return candidates[0]
    widths = [lin.in_features for lin in linears]
    converted = {fmt: [make_linear(lin, fmt) for lin in linears] for fmt in candidates}
    times = dict.fromkeys(candidates, float("inf"))
    for _ in range(2):  # alternated: noise from other processes hits both alike
        for fmt in candidates:
            times[fmt] = min(times[fmt], forward_seconds(converted[fmt], widths))
    return min(candidates, key=times.__getitem__)
