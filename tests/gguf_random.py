"""Random Llama GGUFs of real shapes (e.g. Llama-3-8B's) in llama.cpp's Q4_K_M mix, written tensor by tensor so
that writing a 5 GB file costs one tensor of memory; and the peak RSS of `specdecode generate` on such a file.

Blocks are random bytes with small finite fp16 scales: valid blocks of their type, and cheap to make."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

T = GGMLQuantizationType
_FP16_FIELDS = {T.Q4_K: (0, 2), T.Q6_K: (208,)}


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    ff: int
    heads: int
    kv_heads: int
    vocab: int
    context: int = 512


LLAMA3_8B = Shape(layers=32, hidden=4096, ff=14336, heads=32, kv_heads=8, vocab=128256)


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's Q4_K_M rule for which layers' attn_v and ffn_down take Q6_K."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _tensors(s: Shape) -> list[tuple[str, tuple[int, int] | tuple[int], T]]:
    """(name, [rows, columns] or [n], type) in file order, Q4_K_M's mix."""
    hd = s.hidden // s.heads
    out: list[tuple[str, tuple[int, int] | tuple[int], T]] = [("token_embd.weight", (s.vocab, s.hidden), T.Q4_K)]
    for i in range(s.layers):
        p, more = f"blk.{i}.", _more_bits(i, s.layers)
        out += [(p + "attn_norm.weight", (s.hidden,), T.F32), (p + "ffn_norm.weight", (s.hidden,), T.F32),
                (p + "attn_q.weight", (s.hidden, s.hidden), T.Q4_K),
                (p + "attn_k.weight", (s.kv_heads * hd, s.hidden), T.Q4_K),
                (p + "attn_v.weight", (s.kv_heads * hd, s.hidden), T.Q6_K if more else T.Q4_K),
                (p + "attn_output.weight", (s.hidden, s.hidden), T.Q4_K),
                (p + "ffn_gate.weight", (s.ff, s.hidden), T.Q4_K), (p + "ffn_up.weight", (s.ff, s.hidden), T.Q4_K),
                (p + "ffn_down.weight", (s.hidden, s.ff), T.Q6_K if more else T.Q4_K)]
    return [*out, ("output_norm.weight", (s.hidden,), T.F32), ("output.weight", (s.vocab, s.hidden), T.Q6_K)]


def _data(shape: tuple[int, ...], qtype: T, rng: np.random.Generator) -> np.ndarray:
    if qtype == T.F32:
        return np.ones(shape, dtype=np.float32)
    rows, cols = shape
    bk, ts = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows, cols // bk, ts), dtype=np.uint8)
    for off in _FP16_FIELDS[qtype]:
        scale = rng.uniform(0.0005, 0.002, size=(rows, cols // bk)).astype(np.float16)
        blocks[:, :, off : off + 2] = scale.view(np.uint8).reshape(rows, cols // bk, 2)
    return blocks.reshape(rows, -1)


def _tokenizer(writer: gguf.GGUFWriter, vocab: int) -> None:
    """A byte-level BPE vocabulary of `vocab` tokens: the 256 byte symbols, one merge, fillers, one EOS."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    symbols = [chr(b) for b in printable] + [chr(256 + i) for i in range(len(shifted))]  # GPT-2's byte symbols
    tokens = [*symbols, "Ġt", *(f"tok{i}" for i in range(vocab - len(symbols) - 2)), "<|endoftext|>"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (vocab - 1) + [3])
    writer.add_token_merges(["Ġ t"])
    writer.add_bos_token_id(vocab - 1)
    writer.add_eos_token_id(vocab - 1)


def write_random_llama(path: Path, s: Shape, seed: int = 0) -> Path:
    """A random Q4_K_M Llama GGUF of shape `s` at `path`."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(s.layers)
    writer.add_context_length(s.context)
    writer.add_embedding_length(s.hidden)
    writer.add_feed_forward_length(s.ff)
    writer.add_head_count(s.heads)
    writer.add_head_count_kv(s.kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(500000.0)
    _tokenizer(writer, s.vocab)
    tensors = _tensors(s)
    for name, shape, qtype in tensors:
        if qtype == T.F32:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), 4 * shape[0])
        else:
            bk, ts = GGML_QUANT_SIZES[qtype]
            writer.add_tensor_info(name, (shape[0], shape[1] // bk * ts), np.dtype(np.uint8),
                                   shape[0] * shape[1] // bk * ts, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, shape, qtype in tensors:
        writer.write_tensor_data(_data(shape, qtype, rng))
    writer.close()
    return path


_CHILD = """
import json, resource, sys
def kib(field):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field + ":"))
import gc
import specdecode.cli
from specdecode.model.load import load_tokenizer
load_tokenizer(__import__("pathlib").Path(sys.argv[sys.argv.index("--model") + 1]))  # the machinery it loads
gc.collect()
base = kib("VmRSS")
rc = specdecode.cli.main(sys.argv[1:])
print(json.dumps({"rc": rc, "base_rss": base * 1024, "peak_rss": kib("VmHWM") * 1024,
                  "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def generate_peak_rss(model: Path, tokens: int, max_model_len: int, timeout: float = 1200) -> dict[str, int]:
    """Run `specdecode generate --quantization gguf` on `model` in a child process: its peak RSS (`peak_rss`,
    bytes, the interpreter and torch included) and its RSS before loading the model (`base_rss`: after
    importing specdecode and torch and loading the file's tokenizer once, which brings in ~60 MB of
    transformers' machinery whatever the model)."""
    argv = [sys.executable, "-c", _CHILD, "generate", "--model", str(model), "--quantization", "gguf",
            "--max-model-len", str(max_model_len), "--max-tokens", str(tokens), "--ignore-eos", "--json", "-q",
            "Hello"]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["rc"] == 0, proc.stdout[-2000:]
    return out
