"""Memory bandwidth and the memory floor of plain decoding.

Plain decoding of one token reads every weight once (the embedding table excepted: a token
reads one row of it), so on a memory-bound machine

    floor tokens/s = read bandwidth (bytes/s) / weight bytes read per token

is an upper bound on plain tokens/s. The report shows plain tokens/s ÷ floor tokens/s: how
close the engine is to the hardware.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn


def measure_bandwidth(gigabytes: float = 1.0, repeats: int = 5) -> dict[str, Any]:
    """Best-of-N read bandwidth (``tensor.sum()``) and copy bandwidth (``dst.copy_(src)``) in GB/s.

    Read bandwidth counts the bytes of the tensor summed; copy bandwidth counts bytes read plus
    bytes written. The tensor should be much larger than the last-level cache (1-2 GB).
    """
    n = max(1, int(gigabytes * 1e9) // 4)
    src = torch.ones(n, dtype=torch.float32)
    nbytes = src.numel() * src.element_size()
    read_best = copy_best = float("inf")
    src.sum()  # touch every page before timing
    for _ in range(repeats):
        t0 = time.perf_counter()
        src.sum()
        read_best = min(read_best, time.perf_counter() - t0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        copy_best = min(copy_best, time.perf_counter() - t0)
    del src, dst
    return {
        "bytes": nbytes,
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "read_gb_per_s": nbytes / read_best / 1e9,
        "copy_gb_per_s": 2 * nbytes / copy_best / 1e9,
    }


def _tensor_bytes(t: torch.Tensor) -> int:
    # Opaque (mkldnn-packed) tensors have no storage; their element count is still right.
    return t.numel() * t.element_size()


def _tensor_key(t: torch.Tensor) -> tuple[Any, ...]:
    try:
        return ("ptr", t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
    except (RuntimeError, NotImplementedError):
        return ("id", id(t))


def _module_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The weight tensors a module reads in its forward.

    Parameters, persistent buffers, and public tensor attributes (our packed Linear formats keep
    ``packed`` / ``weight`` + ``scales`` / ``packed`` + ``scales_zeros`` / ``packed_avx2`` as plain attributes;
    int8-dynamic's FBGEMM object is no tensor and declares its size as ``packed_nbytes``, counted by the caller).
    Underscore attributes (caches, rope tables, test copies) are not weights.
    """
    out: list[tuple[str, torch.Tensor]] = list(module.named_parameters(recurse=False))
    non_persistent = getattr(module, "_non_persistent_buffers_set", set())
    out += [(n, b) for n, b in module.named_buffers(recurse=False) if n not in non_persistent]
    seen = {n for n, _ in out}
    for name, value in vars(module).items():
        if isinstance(value, torch.Tensor) and not name.startswith("_") and name not in seen:
            out.append((name, value))
    return out


def weight_bytes_per_token(model: nn.Module) -> dict[str, Any]:
    """Bytes of weights one plain decode step reads: every weight except embedding tables.

    A tied output matrix is the embedding's tensor but is read whole by the LM head, so it is
    counted (once) there.
    """
    embedding: dict[tuple[Any, ...], int] = {}
    counted: dict[tuple[Any, ...], int] = {}
    by_kind: dict[str, int] = {}
    for _, module in model.named_modules():
        for _, t in _module_tensors(module):
            key = _tensor_key(t)
            if isinstance(module, nn.Embedding):
                embedding[key] = _tensor_bytes(t)
                continue
            if key in counted:
                continue
            counted[key] = _tensor_bytes(t)
            kind = type(module).__name__
            by_kind[kind] = by_kind.get(kind, 0) + counted[key]
        opaque = getattr(module, "packed_nbytes", 0)  # weights held by a non-tensor object (FBGEMM's)
        if opaque:
            counted[("opaque", id(module))] = opaque
            kind = type(module).__name__
            by_kind[kind] = by_kind.get(kind, 0) + opaque
    excluded = sum(b for k, b in embedding.items() if k not in counted)
    return {"bytes": sum(counted.values()), "embedding_bytes_excluded": excluded, "by_module_type": by_kind}


def module_bytes(module: nn.Module) -> int:
    """Bytes a module's unique tensors (and opaque packed weights) occupy, embeddings included."""
    seen: dict[tuple[Any, ...], int] = {}
    for _, sub in module.named_modules():
        for _, t in _module_tensors(sub):
            seen.setdefault(_tensor_key(t), _tensor_bytes(t))
        opaque = getattr(sub, "packed_nbytes", 0)
        if opaque:
            seen[("opaque", id(sub))] = opaque
    return sum(seen.values())


def memory_floor(bandwidth_gb_per_s: float, weight_bytes: int) -> float:
    """Upper bound on plain tokens/s when every weight byte is read once per token."""
    return bandwidth_gb_per_s * 1e9 / weight_bytes if weight_bytes else float("inf")


def median_probe(probes: list[dict[str, Any]]) -> dict[str, Any]:
    """The probe of median read bandwidth (the lower one of an even count) among a resumed run's sessions,
    with every probe's read GB/s listed: on a shared machine one probe can land on a quiet or a busy
    moment, and the floor should not hang on it."""
    if not probes:
        raise ValueError("no bandwidth probes")
    ranked = sorted(probes, key=lambda b: b["read_gb_per_s"])
    return {**ranked[(len(ranked) - 1) // 2], "probes_read_gb_per_s": [b["read_gb_per_s"] for b in probes]}
