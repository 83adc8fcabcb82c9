"""Adaptive k with a useless drafter: throughput must stay within 10% of plain decoding.

The drafter is the 0.5B draft's architecture and tokenizer with *random* weights (so its
vocabulary matches the target's and it costs as much as the real draft, but nothing it
proposes is accepted). Plain and speculative runs use the same prompts in one process.

    python benchmarks/useless_draft.py [--prompts 5] [--max-tokens 96]
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specdecode import LLM, SamplingParams
from specdecode.bench.datasets import load_prompts
from specdecode.fetch import resolve_model
from specdecode.model.load import hf_checkpoint_dir

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


def random_copy(src: Path, dst: Path, seed: int = 0) -> Path:
    """Same config and tokenizer as src, weights drawn at random with each tensor's own scale."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f.resolve(), dst / f.name)
    gen = torch.Generator().manual_seed(seed)
    tensors = load_file(str(src / "model.safetensors"))
    rand = {k: (torch.randn(v.shape, generator=gen) * v.float().std()).to(v.dtype) for k, v in tensors.items()}
    save_file(rand, str(dst / "model.safetensors"))
    return dst


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> dict:
    llm.generate([prompts[0][:32]], SamplingParams(max_tokens=8, temperature=0))  # warm-up
    outs = llm.generate(prompts, params)
    tps = [o.metrics["tokens_per_second"] for o in outs]
    return {
        "mean_tokens_per_second": sum(tps) / len(tps),
        "draft_tokens": sum(o.metrics["draft_tokens"] for o in outs),
        "accepted_tokens": sum(o.metrics["accepted_tokens"] for o in outs),
        "steps": sum(o.metrics["steps"] for o in outs),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        useless = random_copy(hf_checkpoint_dir(resolve_model(DRAFT), torch.bfloat16), Path(tmp) / "random-draft")
        plain = LLM(TARGET)
        prompts = [plain.chat_prompt_ids(p.messages)
                   for p in load_prompts("humaneval", limit=args.prompts)]
        results = {"plain": run(plain, prompts, params)}
        del plain
        gc.collect()
        spec = LLM(TARGET, speculative_config={"method": "draft", "model": str(useless)})
        results["draft-auto-useless"] = run(spec, prompts, params)
    ratio = results["draft-auto-useless"]["mean_tokens_per_second"] / results["plain"]["mean_tokens_per_second"]
    results["ratio_vs_plain"] = ratio
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
