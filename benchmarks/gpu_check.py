"""One short check of the engine's CUDA path, for a session that is lent a GPU machine.

No model file can reach that machine (it has no network and a call carries 64 MiB), so the check uses
random weights, which is enough for both things it measures:

1. exactness on CUDA: greedy output of every speculative method (ngram, draft model chain and tree,
   random EAGLE and Medusa heads, continuous batching) equals plain greedy output, fp32, tiny random
   models, as the CPU tests check; seeded sampling runs and repeats;
2. absolute speed on CUDA for models of the Qwen2.5 1.5B / 0.5B shapes in bf16 (speed does not depend
   on the weights' values): the cost of a target forward by number of rows (what verification costs),
   plain tokens/s, and the upper bound of speculation with a draft that is always right (the target
   drafting for itself) against a useless one (a random 0.5B draft).

    python benchmarks/gpu_check.py --out DIR          # writes DIR/gpu_check.json and prints a report
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import _save_tokenizer, make_tiny_hf_dir  # noqa: E402 - the tests' tiny checkpoints
from tiny_helpers import GREEDY, tiny_prompts  # noqa: E402 - and their prompts

from specdecode import LLM, SamplingParams  # noqa: E402
from specdecode.heads.persist import new_head, save_head  # noqa: E402
from specdecode.model.load import load_model  # noqa: E402

QWEN_SHAPES = {  # Qwen2.5(-Coder) 1.5B and 0.5B: the real pair's shapes, random weights
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12),
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14),
    "small": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4),  # dry run
}


def random_qwen_dir(path: Path, shape: str, device: str) -> Path:
    """A Qwen2 checkpoint of a real shape with random bf16 weights (a tiny tokenizer: ids are what count)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    path.mkdir(parents=True, exist_ok=True)
    _save_tokenizer(path, 320)
    cfg = Qwen2Config(vocab_size=151936, num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6,
                      rope_theta=1e6, tie_word_embeddings=True, eos_token_id=2, bos_token_id=0, pad_token_id=0,
                      **QWEN_SHAPES[shape])
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def check_exactness(work: Path, device: str) -> dict[str, Any]:
    """Every method's greedy output equals plain greedy output on CUDA (fp32, tiny random models)."""
    target, other = make_tiny_hf_dir(work / "tiny", "llama", seed=0), make_tiny_hf_dir(work / "other", "llama", seed=1)
    plain = LLM(str(target), dtype="fp32", device=device)
    prompts = tiny_prompts(plain)
    ref = [o.token_ids for o in plain.generate(prompts, GREEDY)]
    cpu_ref = [o.token_ids for o in LLM(str(target), dtype="fp32", device="cpu").generate(prompts, GREEDY)]
    heads = {}
    for kind in ("eagle", "medusa"):
        head = new_head(plain.target.model, kind, torch.arange(0, plain.target.config.vocab_size, 2), seed=3)
        heads[kind] = work / kind
        save_head(head, heads[kind])
    configs = {
        "ngram": {"method": "ngram", "num_speculative_tokens": 4},
        "draft-self": {"method": "draft", "model": str(target), "num_speculative_tokens": 4},
        "draft-random": {"method": "draft", "model": str(other), "num_speculative_tokens": 4},
        "draft-tree": {"method": "draft", "model": str(target), "num_speculative_tokens": 4, "draft_tree_width": 2},
        "eagle": {"method": "eagle", "model": str(heads["eagle"]), "num_speculative_tokens": 4},
        "medusa": {"method": "medusa", "model": str(heads["medusa"]), "num_speculative_tokens": 4},
        "eagle-auto": {"method": "eagle", "model": str(heads["eagle"])},
    }
    out: dict[str, Any] = {"cuda_equals_cpu_plain": ref == cpu_ref}
    for name, cfg in configs.items():
        try:
            out[name] = check_method(target, prompts, ref, cfg, device)
        except Exception:  # one broken method must not hide the others' results
            out[name] = {"error": traceback.format_exc(limit=4)}
    return out


def check_method(target: Path, prompts: list[list[int]], ref: list[list[int]], cfg: dict[str, Any],
                 device: str) -> dict[str, Any]:
    """Greedy output equals plain (alone and in continuous batching); seeded sampling repeats."""
    llm = LLM(str(target), dtype="fp32", device=device, speculative_config=cfg)
    got = llm.generate(prompts, GREEDY)
    steps = sum(o.metrics["steps"] for o in got)
    out: dict[str, Any] = {"equal": [o.token_ids for o in got] == ref,
                           "batched_equal": run_batch(llm, prompts * 2, GREEDY) == ref * 2,
                           "tau": round(sum(len(o.token_ids) for o in got) / max(1, steps), 2)}
    sampled = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, top_k=50, seed=7)
    a, b = (llm.generate(prompts[:1], sampled)[0].token_ids for _ in range(2))
    out["sampling_repeats"] = a == b
    penalised = SamplingParams(max_tokens=24, temperature=0.7, min_p=0.05, repetition_penalty=1.2,
                               presence_penalty=0.3, seed=7)
    out["sampling_penalties_tokens"] = len(llm.generate(prompts[:1], penalised)[0].token_ids)
    return out


def run_batch(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """Continuous batching: all requests in, step until done, outputs in request order."""
    engine = llm.batch_engine(max_num_seqs=4)
    seqs = [llm.new_sequence(p, params) for p in prompts]
    for seq in seqs:
        engine.add(seq)
    while engine.has_work():
        engine.step()
    return [s.output_ids for s in seqs]


def sync(device: str | torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def forward_ms(model: torch.nn.Module, rows: int, context: int, device: str, reps: int = 20) -> float:
    """One target forward of `rows` new tokens after `context` cached ones, with the last row's logits."""
    cache = model.new_cache(1, context + rows + 1)
    with torch.inference_mode():
        model(torch.ones(1, context, dtype=torch.long, device=device),
              torch.arange(context, device=device)[None], cache)
        tokens = torch.full((1, rows), 5, dtype=torch.long, device=device)
        positions = torch.arange(context, context + rows, device=device)[None]
        samples = []
        for _ in range(reps):
            cache.set_length(0, context)
            sync(device)
            t0 = time.perf_counter()
            hidden = model(tokens, positions, cache)
            model.compute_logits(hidden[0]).argmax(-1).cpu()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples[3:]) * 1e3


def tokens_per_s(llm: LLM, prompt: list[int], tokens: int) -> dict[str, float]:
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))  # warm-up
    sync(llm.device)
    t0 = time.perf_counter()
    out = llm.generate([prompt], params)[0]
    dt = time.perf_counter() - t0
    return {"tok_s": round(len(out.token_ids) / dt, 1), "tau": round(out.metrics["mean_accepted_length"], 2)}


def check_speed(work: Path, device: str, small: bool = False) -> dict[str, Any]:
    target = random_qwen_dir(work / "q15", "small" if small else "1.5b", device)
    draft = random_qwen_dir(work / "q05", "small" if small else "0.5b", device)
    plain = LLM(str(target), dtype="bf16", device=device)
    model = plain.target.model
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    out: dict[str, Any] = {"gpu": gpu, "torch": torch.__version__}
    rows = (1, 2, 4, 8, 16, 32, 64)
    out["forward_ms_by_rows_at_512"] = {m: round(forward_ms(model, m, 512, device), 2) for m in rows}
    prompt = list(range(100, 300))
    out["plain"] = tokens_per_s(plain, prompt, 256)
    del plain, model
    head = work / "eagle-q15"  # an untrained head over a quarter of the vocabulary: the tree path's cost
    raw = load_model(str(target), torch.bfloat16, device).model
    save_head(new_head(raw, "eagle", torch.arange(0, raw.config.vocab_size, 4), seed=3), head)
    del raw
    torch.cuda.empty_cache()
    for name, cfg in {
        "eagle-random-head": {"method": "eagle", "model": str(head)},
        "draft-self-k4": {"method": "draft", "model": str(target), "num_speculative_tokens": 4},
        "draft-random05-k4": {"method": "draft", "model": str(draft), "num_speculative_tokens": 4},
        "draft-random05-auto": {"method": "draft", "model": str(draft)},
        "ngram-auto": {"method": "ngram"},
    }.items():
        llm = LLM(str(target), dtype="bf16", device=device, speculative_config=cfg)
        out[name] = tokens_per_s(llm, prompt, 256)
        if torch.cuda.is_available():
            out[name]["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        del llm
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("bench-out/gpu_check"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="dry run on any machine: small random shapes")
    ap.add_argument("--parts", default="exactness,speed")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {}
    parts = {"exactness": lambda: check_exactness(args.work, args.device),
             "speed": lambda: check_speed(args.work, args.device, args.small)}
    for part in args.parts.split(","):
        fn = parts[part]
        t0 = time.perf_counter()
        try:
            report[part] = fn()
        except Exception:  # report what broke and go on to the next part
            report[part] = {"error": traceback.format_exc()}
        report[part + "_seconds"] = round(time.perf_counter() - t0, 1)
        print(json.dumps({part: report[part]}, indent=1), flush=True)
        (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
