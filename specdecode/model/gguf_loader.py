"""Read a GGUF file (llama.cpp's format) into our config and a HF-named state dict.

Dequantization is the `gguf` package's; we only map names and undo the Q/K row
permutation that llama.cpp's converter applies to Llama-architecture checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize

from specdecode.model.config import SUPPORTED_ARCHS, ModelConfig, UnsupportedModelError


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


def config_from_gguf(reader: GGUFReader) -> ModelConfig:
    meta = metadata(reader)
    arch = str(meta.get("general.architecture"))
    if arch not in SUPPORTED_ARCHS:
        raise UnsupportedModelError(f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}")
    names = {t.name for t in reader.tensors}
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    vocab = int(embd.shape[1])  # GGUF shapes are in ggml order: [cols, rows]
    heads = int(meta[f"{arch}.attention.head_count"])
    hidden = int(meta[f"{arch}.embedding_length"])
    return ModelConfig(
        arch=arch,  # type: ignore[arg-type]
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(meta[f"{arch}.feed_forward_length"]),
        num_layers=int(meta[f"{arch}.block_count"]),
        num_heads=heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(meta.get(f"{arch}.attention.key_length", hidden // heads)),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(meta[f"{arch}.attention.layer_norm_rms_epsilon"]),
        max_position_embeddings=int(meta.get(f"{arch}.context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
    )


_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_name(gguf_name: str) -> str | None:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'; None if unknown."""
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _TOP_NAMES:
        return f"{_TOP_NAMES[parts[0]]}.{parts[1]}"
    return None


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's convert-time permutation of Q/K rows (interleaved -> rotate_half)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iter_state_dict(
    reader: GGUFReader, cfg: ModelConfig, dtype: torch.dtype, on_tensor: Callable[[str], None] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, tensor) one at a time so peak memory stays near the final size."""
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue  # e.g. rope_freqs: not needed by our runtime
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
        if on_tensor is not None:
            on_tensor(name)
        arr = np.ascontiguousarray(arr)
        if not arr.flags.writeable:  # F32 tensors are views of the read-only memory map
            arr = arr.copy()
        yield name, torch.from_numpy(arr).to(dtype)
