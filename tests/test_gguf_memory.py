"""Memory of `quantization="gguf"`: the accounting counts what loading holds, and `specdecode generate` on a random
Q4_K_M GGUF runs in about the file's size plus the KV cache (peak RSS of a child process).

The 8B-shaped run (Llama-3-8B's shapes, a 4.9 GB file in a temporary directory, ~5 GB of memory, minutes) is
marked `heavy`, excluded by default: `python -m pytest -q -m heavy tests/test_gguf_memory.py`.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from gguf_random import LLAMA3_8B, Shape, generate_peak_rss, write_random_llama

from specdecode.model import gguf_linear
from specdecode.model.gguf_model import held_bytes, load_native, weight_bytes

pytestmark = pytest.mark.skipif(not gguf_linear.available(), reason="GGUF kernels need a C compiler")

SMALL = Shape(layers=8, hidden=2048, ff=8192, heads=16, kv_heads=4, vocab=8192, context=256)  # 0.3 GB
MAX_LEN = 256


def kv_bytes(s: Shape, max_len: int) -> int:
    """The target's KV cache as `generate` allocates it: bf16 K and V, max_len slots and a tree's 64 more."""
    return 2 * s.layers * s.kv_heads * (s.hidden // s.heads) * 2 * (max_len + 64)


def test_held_bytes_count_what_loading_holds(tmp_path: Path) -> None:
    path = write_random_llama(tmp_path / "tiny.gguf", Shape(layers=2, hidden=512, ff=1024, heads=4, kv_heads=2,
                                                             vocab=4096))
    model, _ = load_native(path, torch.bfloat16)
    embedding = model.model.embed_tokens.raw.nbytes  # mapped, not a parameter
    assert held_bytes(path, torch.bfloat16) == weight_bytes(model) + embedding
    assert abs(held_bytes(path, torch.bfloat16) / path.stat().st_size - 1) < 0.03  # the rest: the header


def test_generate_small_within_file_plus_kv(tmp_path: Path) -> None:
    """Peak RSS above the process's RSS before loading (the interpreter, torch's libraries, transformers'
    tokenizer machinery: ~0.33 GB whatever the model) <= 1.3 x (file + KV cache)."""
    path = write_random_llama(tmp_path / "small.gguf", SMALL)
    rss = generate_peak_rss(path, tokens=4, max_model_len=MAX_LEN)
    budget = 1.3 * (path.stat().st_size + kv_bytes(SMALL, MAX_LEN))
    print(f"peak RSS above the base {(rss['peak_rss'] - rss['base_rss']) / budget * 1.3:.3f} x (file + KV)")
    assert rss["peak_rss"] - rss["base_rss"] <= budget, (rss, budget)


@pytest.mark.heavy
def test_generate_8b_within_file_plus_kv(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Llama-3-8B's shapes in Q4_K_M: the whole process's peak RSS <= 1.2 x (file + KV cache)."""
    tmp = tmp_path_factory.mktemp("gguf8b")
    need = 5.2 * 2**30
    if shutil.disk_usage(tmp).free < need:
        pytest.skip(f"needs {need / 2**30:.1f} GiB free in {tmp}")
    path = write_random_llama(tmp / "llama3-8b-shaped-q4_k_m.gguf", LLAMA3_8B)
    try:
        size = path.stat().st_size
        rss = generate_peak_rss(path, tokens=4, max_model_len=MAX_LEN, timeout=1800)
        budget = 1.2 * (size + kv_bytes(LLAMA3_8B, MAX_LEN))
        print(f"file {size / 2**30:.2f} GiB, peak RSS {rss['peak_rss'] / 2**30:.2f} GiB "
              f"({rss['peak_rss'] / (size + kv_bytes(LLAMA3_8B, MAX_LEN)):.3f} x file + KV)")
        assert rss["peak_rss"] <= budget, (rss, budget)
    finally:
        path.unlink(missing_ok=True)
