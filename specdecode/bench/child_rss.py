"""Peak RSS of one plain engine alone: a child process loads the model, generates for one prompt and reports its
own peak (VmHWM), so nothing of the benchmark process (other methods' engines, the peers, the allocator's
retained memory) counts. The benchmark measures our plain methods (e.g. `plain@gguf`) and llama.cpp's plain
peer this way: the same prompt ids, tokens, context size and threads for both.

`python .../child_rss.py '<json>'` is the child, run as a script so that the package (and torch with it) is
imported only for our engine: llama.cpp's child (llama-cpp-python) holds the interpreter, numpy and llama.cpp.
`peak_rss_alone` starts it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _run_ours(job: dict[str, Any]) -> int:
    from specdecode import LLM, SamplingParams

    llm = LLM(job["model"], dtype=job["dtype"], max_model_len=job["n_ctx"], quantization=job["quantization"])
    params = SamplingParams(max_tokens=job["max_tokens"], temperature=0.0)
    seq = llm.run_sequences([llm.new_sequence(job["prompt_ids"], params)])[0]
    return len(seq.to_output().token_ids)


def _run_llamacpp(job: dict[str, Any]) -> int:
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:  # the peer's other binding (`peer_llamacpp.llamacpp_binding`)
        from specdecode.bench.llamacpp_cffi import CffiLlama

        llm = CffiLlama(job["model"], n_threads=job["threads"], n_ctx=job["n_ctx"], seed=0, temperature=0.0)
        return len(llm.generate(job["prompt_ids"], job["max_tokens"], {llm.token_eos()}))
    from llama_cpp import Llama

    llm = Llama(model_path=job["model"], n_threads=job["threads"], n_ctx=job["n_ctx"], verbose=False, seed=0)
    out = []
    for tok in llm.generate(job["prompt_ids"], temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
        out.append(int(tok))
        if tok == llm.token_eos() or len(out) >= job["max_tokens"]:
            break
    return len(out)


def _child(job: dict[str, Any]) -> dict[str, Any]:
    base = _status_bytes("VmRSS")
    if job["engine"] == "llama.cpp":
        tokens = _run_llamacpp(job)
    else:
        import torch

        torch.set_num_threads(job["threads"])
        tokens = _run_ours(job)
    return {"peak_rss_bytes": _status_bytes("VmHWM"), "rss_before_load_bytes": base, "tokens": tokens}


def peak_rss_alone(engine: str, model: str, prompt_ids: list[int], max_tokens: int, n_ctx: int, threads: int,
                   dtype: str = "bf16", quantization: str = "none", timeout: float = 1800) -> dict[str, Any]:
    """Run one plain generation of `engine` ("specdecode" or "llama.cpp") in a child process: its peak RSS
    (`peak_rss_bytes`, the interpreter and libraries included), its RSS before loading and the tokens made."""
    job = {"engine": engine, "model": model, "prompt_ids": prompt_ids, "max_tokens": max_tokens, "n_ctx": n_ctx,
           "threads": threads, "dtype": dtype, "quantization": quantization}
    root = str(Path(__file__).resolve().parents[2])  # where `specdecode` imports from
    env = {**os.environ, "OMP_NUM_THREADS": str(threads),
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), json.dumps(job)], capture_output=True,
                          text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{engine} child exited {proc.returncode}: {proc.stderr.strip()[-500:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    print(json.dumps(_child(json.loads(sys.argv[1]))))
