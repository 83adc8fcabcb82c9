"""Read a GGUF file (llama.cpp's format) into our config and a HF-named state dict.

Dequantization is the `gguf` package's; we only map names and undo what llama.cpp's converter did
(the Q/K row permutation of Llama-architecture checkpoints, Gemma's +1 on norm weights: `architectures`).
"""

from __future__ import annotations

import dataclasses
import mmap
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize

from specdecode.model import architectures
from specdecode.model.config import ModelConfig, UnsupportedModelError


class CorruptModelError(ValueError):
    """The file is not a readable GGUF (truncated, damaged, or another format)."""


def open_gguf(path: Path) -> GGUFReader:
    try:
        return GGUFReader(str(path))
    except Exception as exc:  # the reader raises ValueError/struct errors/IndexError on damage
        raise CorruptModelError(f"{path} is not a readable GGUF file ({type(exc).__name__}: {exc})") from exc


def metadata(reader: GGUFReader) -> dict[str, object]:
    """Scalar and string metadata; large arrays (vocab, merges) are left out."""
    out: dict[str, object] = {}
    for key, field in reader.fields.items():
        if field.types and field.types[0] == GGUFValueType.ARRAY and len(field.data) > 64:
            continue
        out[key] = field.contents()
    return out


# struct formats of GGUF's scalar value types (GGUFValueType numbering).
_SCALAR_FMT = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def read_gguf_header(path: Path) -> tuple[dict[str, object], dict[str, tuple[int, ...]]]:
    """(metadata, tensor shapes in ggml order) straight from the file's header, no tensor data.

    GGUFReader builds a numpy view per vocabulary string, which takes seconds for a 150k-token
    vocab; reading a config needs only the scalars, so arrays longer than 64 are skipped here.
    """
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse_header(buf)
    except (ValueError, struct.error, IndexError, OverflowError, UnicodeDecodeError, OSError) as exc:
        raise CorruptModelError(f"{path} is not a readable GGUF file ({type(exc).__name__}: {exc})") from exc


def _parse_header(
    buf: mmap.mmap, table: list[tuple[str, tuple[int, ...], int, int]] | None = None
) -> tuple[dict[str, object], dict[str, tuple[int, ...]]]:
    """table: if given, receives (name, ggml dims, type id, data offset) per tensor, then ("", (), -1, end of
    the tensor infos) (gguf_types.check_gguf_tensors)."""
    if buf[:4] != b"GGUF":
        raise ValueError("GGUF magic invalid")
    (version,) = struct.unpack_from("<I", buf, 4)
    e = ">" if version & 0xFFFF == 0 else "<"  # a file written for the other byte order
    n_tensors, n_kv = struct.unpack_from(e + "QQ", buf, 8)
    off = 24
    size = len(buf)

    def string(off: int) -> tuple[str, int]:
        (n,) = struct.unpack_from(e + "Q", buf, off)
        if off + 8 + n > size:
            raise ValueError("string runs past the end of the file")
        return buf[off + 8 : off + 8 + n].decode("utf-8"), off + 8 + n

    def value(vtype: int, off: int) -> tuple[object, int]:
        if vtype == _STRING:
            return string(off)
        if vtype == _ARRAY:
            etype, count = struct.unpack_from(e + "IQ", buf, off)
            off += 12
            if etype in _SCALAR_FMT and count > 64:  # skip without reading
                off += struct.calcsize(_SCALAR_FMT[etype]) * count
                if off > size:
                    raise ValueError("array runs past the end of the file")
                return None, off
            if etype == _STRING and count > 64:  # e.g. the vocabulary: step over each string
                for _ in range(count):
                    off += 8 + struct.unpack_from(e + "Q", buf, off)[0]
                if off > size:
                    raise ValueError("array runs past the end of the file")
                return None, off
            items = []
            for _ in range(count):
                item, off = value(etype, off)
                items.append(item)
            return (items if count <= 64 else None), off
        fmt = _SCALAR_FMT.get(vtype)
        if fmt is None:
            raise ValueError(f"unknown GGUF value type {vtype}")
        return struct.unpack_from(e + fmt, buf, off)[0], off + struct.calcsize(fmt)

    meta: dict[str, object] = {}
    for _ in range(n_kv):
        key, off = string(off)
        (vtype,) = struct.unpack_from(e + "I", buf, off)
        val, off = value(vtype, off + 4)
        if val is not None:
            meta[key] = val
    shapes: dict[str, tuple[int, ...]] = {}
    for _ in range(n_tensors):
        name, off = string(off)
        (n_dims,) = struct.unpack_from(e + "I", buf, off)
        shapes[name] = struct.unpack_from(e + f"{n_dims}Q", buf, off + 4)
        off += 4 + 8 * n_dims + 4 + 8  # dims, type, data offset
        if table is not None:
            table.append((name, shapes[name], *struct.unpack_from(e + "IQ", buf, off - 12)))
    if table is not None:
        table.append(("", (), -1, off))
    return meta, shapes


def config_from_gguf(reader: GGUFReader) -> ModelConfig:
    shapes = {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors}
    return with_rope_freqs(config_from_metadata(metadata(reader), shapes), reader)


def with_rope_freqs(cfg: ModelConfig, reader: GGUFReader) -> ModelConfig:
    """The config with the rope_freqs tensor's values (a header-only config has the type, not the values)."""
    if cfg.rope_type != "freq_factors" or cfg.rope_freq_factors is not None:
        return cfg
    tensor = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
    try:
        values = dequantize(tensor.data, tensor.tensor_type).astype(np.float64).reshape(-1)
    except Exception as exc:
        raise CorruptModelError(f"tensor rope_freqs.weight could not be read ({exc})") from exc
    if not np.all(np.isfinite(values)) or np.any(values <= 0):
        raise CorruptModelError("rope_freqs.weight holds non-positive or non-finite frequency factors")
    return dataclasses.replace(cfg, rope_freq_factors=tuple(float(v) for v in values))


def config_from_gguf_file(path: Path) -> ModelConfig:
    """The config from the header alone: fast, reads no weights."""
    return config_from_metadata(*read_gguf_header(path))


def config_from_metadata(meta: dict[str, object], shapes: dict[str, tuple[int, ...]]) -> ModelConfig:
    arch_fields = architectures.config_kwargs_from_gguf(meta, shapes)  # refuses what we do not compute
    arch = arch_fields["arch"]
    if "token_embd.weight" not in shapes:
        raise CorruptModelError("the GGUF has no token_embd.weight tensor")

    def req(key: str) -> object:
        if f"{arch}.{key}" not in meta:
            raise CorruptModelError(f"the GGUF lacks the metadata key {arch}.{key}")
        return meta[f"{arch}.{key}"]

    vocab = int(shapes["token_embd.weight"][1])  # GGUF shapes are in ggml order: [cols, rows]
    heads = int(req("attention.head_count"))
    hidden = int(req("embedding_length"))
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(req("feed_forward_length")),
        num_layers=int(req("block_count")),
        num_heads=heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(meta.get(f"{arch}.attention.key_length", hidden // heads)),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(req("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(meta.get(f"{arch}.context_length", 4096)),
        tie_word_embeddings="output.weight" not in shapes,
        attention_bias="blk.0.attn_q.bias" in shapes,
    )
    return ModelConfig(**{**common, **arch_fields})  # type: ignore[arg-type]


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'; None if unknown."""
    return architectures.gguf_hf_name(arch, gguf_name)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's convert-time permutation of Q/K rows (interleaved -> rotate_half)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iter_state_dict(
    reader: GGUFReader, cfg: ModelConfig, dtype: torch.dtype, on_tensor: Callable[[str], None] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, tensor) one at a time so peak memory stays near the final size."""
    for t in reader.tensors:
        if t.name in architectures.GGUF_NON_WEIGHTS:
            continue  # rope_freqs: read into the config (`with_rope_freqs`)
        name = hf_name(t.name, cfg.arch)
        if name is None:  # a tensor we have no use for would change the maths: never drop one silently
            raise UnsupportedModelError(
                f"tensor {t.name} of this {cfg.arch} GGUF is not part of the supported {cfg.arch} layout"
            )
        try:
            arr = dequantize(t.data, t.tensor_type)
        except NotImplementedError as exc:
            raise UnsupportedModelError(f"tensor {t.name}: quantization {t.tensor_type.name} unsupported") from exc
        except Exception as exc:
            raise CorruptModelError(f"tensor {t.name} could not be read ({exc}); the file may be truncated") from exc
        if cfg.arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            arr = _unpermute(arr, cfg.num_heads)
        elif cfg.arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            arr = _unpermute(arr, cfg.num_kv_heads)
        arr = architectures.gguf_tensor_fixup(cfg, name, arr)
        if on_tensor is not None:
            on_tensor(name)
        arr = np.ascontiguousarray(arr)
        if not arr.flags.writeable:  # F32 tensors are views of the read-only memory map
            arr = arr.copy()
        yield name, torch.from_numpy(arr).to(dtype)
