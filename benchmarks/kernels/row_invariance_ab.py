"""What row-independent numerics cost: milliseconds of a T-token forward (after a 64-token prefix) of a model on its
default CPU path (our kernels: linears at every row count, attention at every length) against the same model with
the torch paths they replace (F.linear past 65 rows in bf16, on every row in fp32; SDPA past 65 queries). Both in
one process, alternated, on one thread's CPU time (a shared machine's other processes then cost neither side
time), best of the rounds.

    python benchmarks/kernels/row_invariance_ab.py [--model qwen2.5-coder-1.5b-instruct] [--dtype bf16|fp32|gguf]
        [--tokens 1,16,128,512] [--rounds 3]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from specdecode.fetch import resolve_model
from specdecode.model.bf16_linear import BF16Linear
from specdecode.model.f32_linear import F32Linear
from specdecode.model.fast_linear import convert_linears, target_linear_format
from specdecode.model.load import load_resolved
from specdecode.model.transformer import EXACT_ATTENTION_TOKENS, Transformer

CONTEXT = 64
_ours = BF16Linear.forward


def _torch_bf16(self: BF16Linear, x: torch.Tensor) -> torch.Tensor:
    if x.numel() // x.shape[-1] > EXACT_ATTENTION_TOKENS:
        return F.linear(x.to(torch.bfloat16), self.weight, self.bias).to(x.dtype)
    return _ours(self, x)


def use_ours(model: Transformer, ours: bool) -> None:
    BF16Linear.forward = _ours if ours else _torch_bf16  # type: ignore[method-assign]
    for m in model.modules():
        if isinstance(m, F32Linear):
            m.native = ours
    for layer in model.model.layers:
        layer.self_attn.native_attend = ours


def forward_ms(model: Transformer, tokens: int) -> float:
    cache = model.new_cache(1, CONTEXT + tokens + 1)
    with torch.inference_mode():
        model(torch.ones(1, CONTEXT, dtype=torch.long), torch.arange(CONTEXT)[None], cache)
        x, pos = torch.full((1, tokens), 5), torch.arange(CONTEXT, CONTEXT + tokens)[None]
        t0 = time.thread_time()
        model.compute_logits(model(x, pos, cache)[:, -1:])
        return (time.thread_time() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32", "gguf"])
    ap.add_argument("--tokens", default="1,16,128,512")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cpu, path = torch.device("cpu"), resolve_model(args.model)
    if args.dtype == "gguf":
        model = load_resolved(path, args.model, torch.bfloat16, cpu, "gguf").model
    else:
        dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
        model = load_resolved(path, args.model, dtype, cpu).model
        convert_linears(model, target_linear_format("none", dtype, cpu))
    print(f"| {args.model} {args.dtype}: T | row-independent ms | torch paths ms | ratio |\n|---:|---:|---:|---:|")
    for t in (int(n) for n in args.tokens.split(",")):
        best = {True: float("inf"), False: float("inf")}
        for _ in range(args.rounds):
            for ours in (True, False):
                use_ours(model, ours)
                best[ours] = min(best[ours], forward_ms(model, t))
        print(f"| {t} | {best[True]:.1f} | {best[False]:.1f} | {best[True] / best[False]:.2f}x |", flush=True)
    use_ours(model, True)


if __name__ == "__main__":
    main()
