"""Which GGUF tensor types we load, and the checks that turn a damaged GGUF into a clear error.

Every type here is dequantized by the `gguf` package (`gguf.quants.dequantize`), bit for bit what llama.cpp's
own converter tooling computes. The tensor table of the header is checked against the file before any weight is
read: an unknown or unsupported type, a row length that is not a whole number of quantization blocks, tensor
data that runs past the end of the file (a truncated download) or overlaps another tensor (a header that lies
about shapes) is refused naming the tensor and the problem, never a numpy error from deep inside the reader.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from specdecode.model.config import ModelConfig, UnsupportedModelError
from specdecode.model.gguf_loader import CorruptModelError, _parse_header

T = GGMLQuantizationType
SUPPORTED_TYPES: tuple[GGMLQuantizationType, ...] = (
    T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K,
)
MAX_DIMS = 4  # GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dims: tuple[int, ...]
    """ggml order: dims[0] is the row length."""
    type_id: int
    offset: int
    """Relative to the start of the data section."""


def supported_names() -> str:
    return ", ".join(t.name for t in SUPPORTED_TYPES)


def read_tensor_table(path: Path) -> tuple[dict[str, object], list[TensorEntry], int, int]:
    """(metadata, tensors, absolute start of the data section, file size), from the header only."""
    table: list[tuple[str, tuple[int, ...], int, int]] = []
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            meta, _ = _parse_header(buf, table)
            size = len(buf)
    except (ValueError, struct.error, IndexError, OverflowError, UnicodeDecodeError, OSError, MemoryError) as exc:
        raise CorruptModelError(f"{path} is not a readable GGUF file ({type(exc).__name__}: {exc})") from exc
    *entries, (_, _, _, infos_end) = table
    align = meta.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise CorruptModelError(f"{path}: general.alignment {align!r} is not a power of two")
    data_start = -(-infos_end // align) * align
    return meta, [TensorEntry(*e) for e in entries], data_start, size


def check_gguf_tensors(path: Path) -> list[TensorEntry]:
    """Refuse a GGUF whose tensor table does not fit the file or names a type we do not load."""
    meta, entries, data_start, size = read_tensor_table(path)
    align = int(meta.get("general.alignment", DEFAULT_ALIGNMENT))  # type: ignore[call-overload]
    spans: list[tuple[int, int, str]] = []
    for t in entries:
        try:
            qtype = GGMLQuantizationType(t.type_id)
        except ValueError:
            raise CorruptModelError(f"{path}: tensor {t.name} has type id {t.type_id}, which is no GGML tensor "
                                    "type (the header is damaged)") from None
        if qtype not in SUPPORTED_TYPES:
            raise UnsupportedModelError(f"{path}: tensor {t.name} is stored as {qtype.name}, which is not "
                                        f"supported; supported tensor types: {supported_names()}")
        if not 1 <= len(t.dims) <= MAX_DIMS or any(d <= 0 for d in t.dims):
            raise CorruptModelError(f"{path}: tensor {t.name} has shape {list(t.dims)} (1 to {MAX_DIMS} positive "
                                    "dimensions expected): the header is damaged")
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        if t.dims[0] % block:
            raise CorruptModelError(f"{path}: tensor {t.name} ({qtype.name}) has rows of {t.dims[0]} values, not a "
                                    f"whole number of {qtype.name} blocks of {block}: the header is damaged")
        if t.offset % align:
            raise CorruptModelError(f"{path}: tensor {t.name}'s data offset {t.offset} is not aligned to {align} "
                                    "bytes: the header is damaged")
        begin = data_start + t.offset
        end = begin + math.prod(t.dims) // block * block_bytes
        if end > size:
            raise CorruptModelError(
                f"{path}: tensor {t.name} ({qtype.name}, shape {list(t.dims)}) needs bytes {begin}..{end} but the "
                f"file has {size} bytes: the file is truncated (or its header is wrong); download it again")
        spans.append((begin, end, t.name))
    spans.sort()
    for (_, end_a, a), (begin_b, _, b) in zip(spans, spans[1:], strict=False):
        if end_a > begin_b:
            raise CorruptModelError(f"{path}: the data of tensors {a} and {b} overlap: the shapes in the header "
                                    "do not match the data (the header is damaged)")
    return entries


def check_state_shapes(path: Path, cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> None:
    """The dequantized tensors against the shapes the header's config implies (before any is stored)."""
    from specdecode.model.transformer import Transformer

    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in Transformer(cfg).state_dict().items()}
    for name, t in tensors.items():
        want = expected.get(name)
        if want is not None and tuple(t.shape) != want:
            raise CorruptModelError(f"{path}: tensor {name} has shape {list(t.shape)} but the model's metadata "
                                    f"({cfg.arch}, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}) implies "
                                    f"{list(want)}: the header's shapes or metadata are wrong")
