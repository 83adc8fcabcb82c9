"""The benchmark's peak RSS of llama.cpp's plain engine alone (`bench.child_rss`) on a random GGUF; ours is run
alone by tests/test_bench_e2e.py."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from gguf_random import Shape, write_random_llama

from specdecode.bench.child_rss import peak_rss_alone

TINY = Shape(layers=2, hidden=512, ff=1024, heads=4, kv_heads=2, vocab=4096, context=256)


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed")
def test_llamacpp_peak_rss_alone(tmp_path: Path) -> None:
    path = write_random_llama(tmp_path / "tiny.gguf", TINY)
    out = peak_rss_alone("llama.cpp", str(path), [1, 2, 3, 4], max_tokens=4, n_ctx=256, threads=1)
    assert 1 <= out["tokens"] <= 4
    assert out["peak_rss_bytes"] > out["rss_before_load_bytes"] > 0
    assert out["peak_rss_bytes"] < 200 * 2**20  # its child holds no torch (~0.3 GB)
