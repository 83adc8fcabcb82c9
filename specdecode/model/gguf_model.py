"""Build our Transformer straight from a GGUF file's quantized blocks (`quantization="gguf"`).

The linears (fused q/k/v and gate/up as in `Transformer.fuse_projections`, o, down, the output matrix) become
`GGUFLinear`s holding the file's blocks re-laid out for the kernel, the token embeddings a `GGUFEmbedding`
reading rows from the memory-mapped file; norms and biases are dequantized into the model dtype as on the
bf16 path. The model's weight bytes are then about the file's size (the tied output matrix is the only copy
of the embeddings in memory; looked-up rows are read from the file's pages).
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize
from torch import nn

from specdecode.model.config import ModelConfig, UnsupportedModelError
from specdecode.model.gguf_linear import GGUFEmbedding, GGUFLinear
from specdecode.model.gguf_loader import CorruptModelError, _unpermute, config_from_gguf_file
from specdecode.model.transformer import Transformer

QUANTIZED = {t for t in GGMLQuantizationType if t not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16,
                                                          GGMLQuantizationType.BF16)}


def _rows(t: TensorInfo) -> int:
    return int(t.shape[1]) if len(t.shape) > 1 else 1  # ggml order: [columns, rows]


@dataclass
class TensorInfo:
    """A tensor of the file: name, shape (ggml order), type, absolute offset and bytes of its data; `data` its
    bytes (uint8 [rows, row bytes]) in the file's mapping."""

    name: str
    shape: tuple[int, ...]
    tensor_type: int
    data_offset: int
    n_bytes: int
    file: np.ndarray

    @property
    def data(self) -> np.ndarray:
        return self.file[self.data_offset : self.data_offset + self.n_bytes].reshape(_rows(self), -1)


_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF scalar value types
_STRING, _ARRAY = 8, 9


def read_tensor_infos(path: Path) -> dict[str, TensorInfo]:
    """The tensors of a (little-endian) GGUF from its header, stepping over the metadata without reading it:
    `GGUFReader` builds an object per vocabulary string (minutes for a 150k vocabulary on a busy 2-core CPU)."""
    file = np.memmap(path, dtype=np.uint8, mode="r")
    buf = memoryview(file)
    if bytes(buf[:4]) != b"GGUF":
        raise CorruptModelError(f"{path} is not a GGUF file")
    n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
    off, alignment = 24, 32

    def skip(vtype: int, off: int) -> int:
        if vtype == _STRING:
            return off + 8 + struct.unpack_from("<Q", buf, off)[0]
        if vtype == _ARRAY:
            etype, count = struct.unpack_from("<IQ", buf, off)
            off += 12
            if etype in _SIZES:
                return off + _SIZES[etype] * count
            for _ in range(count):
                off = skip(etype, off)
            return off
        return off + _SIZES[vtype]

    try:
        for _ in range(n_kv):
            (n,) = struct.unpack_from("<Q", buf, off)
            key = bytes(buf[off + 8 : off + 8 + n]).decode()
            (vtype,) = struct.unpack_from("<I", buf, off + 8 + n)
            off += 12 + n
            if key == "general.alignment":
                (alignment,) = struct.unpack_from("<I", buf, off)
            off = skip(vtype, off)
        infos = []
        for _ in range(n_tensors):
            (n,) = struct.unpack_from("<Q", buf, off)
            name = bytes(buf[off + 8 : off + 8 + n]).decode()
            (dims,) = struct.unpack_from("<I", buf, off + 8 + n)
            shape = struct.unpack_from(f"<{dims}Q", buf, off + 12 + n)
            qtype, rel = struct.unpack_from("<IQ", buf, off + 12 + n + 8 * dims)
            off += 12 + n + 8 * dims + 12
            infos.append((name, shape, qtype, rel))
    except (struct.error, UnicodeDecodeError, KeyError) as exc:
        raise CorruptModelError(f"{path} is not a readable GGUF file ({type(exc).__name__}: {exc})") from exc
    start = -(-off // alignment) * alignment
    out = {}
    for name, shape, qtype, rel in infos:
        bk, ts = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
        n_bytes = int(np.prod(shape)) // bk * ts
        if start + rel + n_bytes > len(file):
            raise CorruptModelError(f"tensor {name} runs past the end of {path}; the file may be truncated")
        out[name] = TensorInfo(name, tuple(int(d) for d in shape), qtype, start + rel, n_bytes, file)
    return out


def _release(done: list[TensorInfo]) -> None:
    """Drop the file's pages of tensors already copied into the kernel's tiles from this process's resident
    memory (they stay in the page cache): without it, loading holds the file twice at its peak."""
    for t in done:
        mm = getattr(t.file, "_mmap", None)  # np.memmap's mapping of the whole file, from offset 0
        if mm is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = t.data_offset - t.data_offset % mmap.PAGESIZE
        mm.madvise(mmap.MADV_DONTNEED, start, min(len(mm), t.data_offset + t.n_bytes) - start)


def load_native(path: Path, dtype: torch.dtype) -> tuple[Transformer, ModelConfig]:
    """The model of a GGUF file with its quantized linears kept in their blocks (CPU)."""
    cfg = config_from_gguf_file(path)
    if cfg.arch not in ("llama", "qwen2") or not cfg.plain_layers or cfg.rope_type != "default" \
            or cfg.sliding_window is not None:
        raise UnsupportedModelError(
            f"quantization 'gguf' runs Llama and Qwen2 GGUFs without RoPE scaling or sliding windows; {path.name} "
            f"({cfg.arch}) loads with the default quantization ('none'), dequantized"
        )
    tensors = read_tensor_infos(path)

    def raw(name: str, heads: int | None = None) -> tuple[int, np.ndarray]:
        t = tensors[name]
        data = t.data
        if heads is not None and cfg.arch == "llama":  # undo llama.cpp's Q/K row order (whole rows of blocks)
            data = _unpermute(data, heads)
        return int(t.tensor_type), data

    def dense(name: str, heads: int | None = None) -> torch.Tensor:
        t = tensors[name]
        arr = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(-1)  # a writable copy
        if heads is not None and cfg.arch == "llama":
            arr = _unpermute(arr, heads)
        return torch.from_numpy(np.ascontiguousarray(arr)).to(dtype)

    def param(name: str) -> nn.Parameter:
        return nn.Parameter(dense(name), requires_grad=False)

    with torch.device("meta"):
        model = Transformer(cfg)
    d, heads, kv_heads = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads
    body = model.model
    def mapped(name: str) -> np.ndarray:
        """The tensor's blocks, in a mapping of their own: the whole file's goes after loading."""
        t = tensors[name]
        return np.memmap(path, dtype=np.uint8, mode="r", offset=int(t.data_offset),
                         shape=(_rows(t), int(t.n_bytes) // _rows(t)))

    emb = tensors["token_embd.weight"]
    if emb.tensor_type in QUANTIZED:
        body.embed_tokens = GGUFEmbedding(int(emb.tensor_type), mapped("token_embd.weight"), d, dtype)
    else:
        body.embed_tokens = nn.Embedding.from_pretrained(dense("token_embd.weight").reshape(-1, d), freeze=True)
    for i, layer in enumerate(body.layers):
        p = f"blk.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        bias = None
        if cfg.attention_bias:
            bias = torch.cat([dense(p + "attn_q.bias", heads), dense(p + "attn_k.bias", kv_heads),
                              dense(p + "attn_v.bias")])
        qkv = [raw(p + "attn_q.weight", heads), raw(p + "attn_k.weight", kv_heads), raw(p + "attn_v.weight")]
        attn.qkv_proj = GGUFLinear(qkv, d, bias=bias, dtype=dtype)
        del attn.q_proj, attn.k_proj, attn.v_proj
        attn.o_proj = GGUFLinear([raw(p + "attn_output.weight")], heads * cfg.head_dim, dtype=dtype)
        mlp.gate_up_proj = GGUFLinear([raw(p + "ffn_gate.weight"), raw(p + "ffn_up.weight")], d, dtype=dtype)
        del mlp.gate_proj, mlp.up_proj
        mlp.down_proj = GGUFLinear([raw(p + "ffn_down.weight")], cfg.intermediate_size, dtype=dtype)
        layer.input_layernorm.weight = param(p + "attn_norm.weight")
        layer.post_attention_layernorm.weight = param(p + "ffn_norm.weight")
        _release([t for name, t in tensors.items() if name.startswith(p)])
    body.norm.weight = param("output_norm.weight")
    out = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    model.lm_head = GGUFLinear([raw(out)], d, dtype=dtype)
    _release([tensors[out]])
    if tensors[out].tensor_type in QUANTIZED:
        model.lm_head.source = (int(tensors[out].tensor_type), mapped(out))  # for `dense_output_rows`
    tensors.clear()  # the linears hold their own copies: the file's mapping goes
    left = [n for n, t in model.named_parameters() if t.is_meta] + [n for n, t in model.named_buffers() if t.is_meta]
    if left:
        raise ValueError(f"GGUF tensors missing for {left}")
    return model.eval(), cfg


@contextmanager
def dense_output_rows(model: nn.Module) -> Iterator[None]:
    """While attaching a draft head: the output matrix and the embeddings as dense tensors in the model dtype
    (`lm_head.weight`, `embed_tokens.weight`), which a head copies rows of and fingerprints; dropped after."""
    emb, head = model.model.embed_tokens, model.lm_head
    if not isinstance(emb, GGUFEmbedding) or not hasattr(head, "source"):
        yield
        return
    dtype, empty = emb.weight.dtype, emb.weight
    table = torch.from_numpy(dequantize(np.asarray(emb.raw), emb.qtype).reshape(-1, emb.dim)).to(dtype)
    emb.weight = nn.Parameter(table, requires_grad=False)
    out = table if model.config.tie_word_embeddings else torch.from_numpy(
        dequantize(np.asarray(head.source[1]), head.source[0]).reshape(-1, emb.dim)).to(dtype)
    head.weight = out
    try:
        yield
    finally:
        emb.weight = empty
        del head.weight


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights as held in memory (quantized blocks, norms, biases)."""
    total = sum(m.weight_bytes for m in model.modules() if isinstance(m, GGUFLinear))
    total += sum(m.bias.numel() * 2 for m in model.modules() if isinstance(m, GGUFLinear) and m.bias is not None)
    return total + sum(p.numel() * p.element_size() for p in model.parameters())


def held_bytes(path: Path, dtype: torch.dtype) -> int:
    """Bytes `load_native` will hold for the file's weights, from its header alone (milliseconds): the blocks of
    the linears the kernel multiplies, dequantized `dtype` copies of the rest (norms, biases, other types), the
    token embeddings' blocks (memory-mapped; resident as rows are read), once more for a tied output matrix."""
    from specdecode.model.gguf_linear import KERNEL_TYPES, TILE, available

    width = torch.finfo(dtype).bits // 8
    kernel = available()
    tensors = read_tensor_infos(path)
    total = 0
    for name, t in tensors.items():
        numel = int(np.prod(t.shape))
        if name == "token_embd.weight":
            total += t.n_bytes if t.tensor_type in QUANTIZED else numel * width  # mapped rows, or nn.Embedding
            if "output.weight" in tensors:
                continue  # else it is the output matrix too, counted below
        if name.endswith(".bias"):
            total += numel * 2  # GGUFLinear keeps biases in bf16
        elif kernel and t.tensor_type in KERNEL_TYPES and _rows(t) % TILE == 0:
            total += t.n_bytes
        else:
            total += numel * width
    return total
