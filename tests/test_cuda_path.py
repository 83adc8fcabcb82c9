"""The engine on CUDA: every method's greedy output equals plain greedy output, alone and in continuous
batching, and seeded sampling (with penalties) runs. Skipped without a GPU (CI has none); a session lent
a GPU runs it, or `python benchmarks/gpu_check.py`, which also measures speed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_every_method_is_exact_on_cuda(tmp_path: Path) -> None:
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    assert spec is not None and spec.loader is not None
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    report = gpu_check.check_exactness(tmp_path, "cuda")
    assert report.pop("cuda_equals_cpu_plain")
    for name, result in report.items():
        assert "error" not in result, result
        assert result["equal"] and result["batched_equal"] and result["sampling_repeats"], name
