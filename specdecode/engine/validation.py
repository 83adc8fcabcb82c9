"""Start-up checks: draft/target compatibility and memory, before any generation."""

from __future__ import annotations

from pathlib import Path

import psutil
import torch

from specdecode.model.bf16_linear import bf16_copies_weights
from specdecode.model.config import ModelConfig
from specdecode.model.tokenizer import Tokenizer
from specdecode.proposers.text_bridge import TextBridge


class IncompatibleDraftError(ValueError):
    """The draft cannot propose tokens the target understands."""


class InsufficientMemoryError(MemoryError):
    """Loading these models with these caches would exceed available memory."""


def vocab_mismatch(target_name: str, target: Tokenizer, draft_name: str, draft: Tokenizer) -> str | None:
    """Why the draft's token ids do not mean the target's strings (naming both models and the first ids), or
    None where they do."""
    tv, dv = target.vocab(), draft.vocab()
    if len(tv) != len(dv):
        first = next((i for i in range(min(len(tv), len(dv))) if tv.get(i) != dv.get(i)), min(len(tv), len(dv)))
        return (f"draft {draft_name!r} has a vocabulary of {len(dv)} tokens but target {target_name!r} has "
                f"{len(tv)}; first differing id {first}: target {tv.get(first)!r} vs draft {dv.get(first)!r}")
    diff = [i for i in sorted(tv) if tv[i] != dv.get(i)]
    if diff:
        shown = ", ".join(f"{i}: target {tv[i]!r} vs draft {dv.get(i)!r}" for i in diff[:3])
        return (f"draft {draft_name!r} and target {target_name!r} map {len(diff)} token ids to different strings; "
                f"first differing ids: {shown}")
    ts, ds = target.special_tokens(), draft.special_tokens()
    if ts["eos"] != ds["eos"]:
        return f"draft {draft_name!r} ends with EOS id {ds['eos']} but target {target_name!r} with {ts['eos']}"
    return None


def cross_vocab_bridge(target_name: str, target: Tokenizer, draft_name: str, draft: Tokenizer,
                       tree_width: int) -> TextBridge | None:
    """None where the draft shares the target's vocabulary; else the `TextBridge` its drafts cross by (as text).
    Refused where that cannot work: a draft tree (its branches are the draft's ids, not the target's), or a
    tokenizer without a fast (Rust) backend whose ids' bytes can be read."""
    why = vocab_mismatch(target_name, target, draft_name, draft)
    if why is None:
        return None
    if tree_width != 1:
        raise IncompatibleDraftError(f"{why}. A draft with another tokenizer drafts chains only: leave "
                                     f"draft_tree_width unset or 1 (got {tree_width})")
    for name, tok in ((target_name, target), (draft_name, draft)):
        if not hasattr(tok.hf, "backend_tokenizer"):
            raise IncompatibleDraftError(f"{why}. Drafting across tokenizers needs fast tokenizers; {name!r} has "
                                         "a slow (Python) one")
    return TextBridge(target.hf, draft.hf)


def check_draft_rows(target_name: str, target_rows: int, draft_name: str, draft_rows: int,
                     tokenizer: Tokenizer) -> tuple[int, int] | None:
    """Output rows of a draft whose tokenizer agrees with the target's (`vocab_mismatch`). Equal: None.
    Padded differently (the Qwen2.5 sizes pad to 151,936 or 152,064): (real vocabulary, target rows) for
    `DraftModelRows(vocab=...)`, which never proposes a padding row. Refused when either model has fewer
    rows than the tokenizer has ids."""
    if draft_rows == target_rows:
        return None
    real = max(tokenizer.vocab(), default=-1) + 1
    if real > min(draft_rows, target_rows):
        raise IncompatibleDraftError(
            f"draft {draft_name!r} has {draft_rows} output rows and target {target_name!r} has {target_rows}, "
            f"but their tokenizer has {real} token ids: the vocabularies ({draft_rows} vs {target_rows}) differ by "
            "more than padding"
        )
    return real, target_rows


def estimate_bytes(cfg: ModelConfig, dtype: torch.dtype, max_len: int, batch: int = 1,
                   device: torch.device | None = None, gguf_file: Path | None = None) -> int:
    """Weights in `dtype` plus a KV cache of max_len tokens per row, plus activation headroom. A tied output
    matrix counts twice where the CPU's bf16 kernel keeps its own re-laid-out copy of it (AVX2 and AMX CPUs).
    `gguf_file`: the weights are that file's blocks, kept as they are (quantization "gguf"): what
    `gguf_model.held_bytes` counts from its header."""
    width = torch.finfo(dtype).bits // 8
    if gguf_file is None:
        weights = cfg.num_parameters() * width
    else:
        from specdecode.model.gguf_model import held_bytes

        weights = held_bytes(gguf_file, dtype)
    on_cpu = device is None or device.type == "cpu"
    if cfg.tie_word_embeddings and dtype == torch.bfloat16 and on_cpu and bf16_copies_weights() and not gguf_file:
        weights += cfg.vocab_size * cfg.hidden_size * width
    kv = cfg.kv_bytes_per_token(width) * max_len * batch
    headroom = 4 * cfg.vocab_size * 4 * 16 + 64 * 2**20  # logits of a 16-token verify + runtime slack
    return weights + kv + headroom


def available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return int(psutil.virtual_memory().available)


def check_memory(parts: list[tuple[str, int]], device: torch.device,
                 advice: str = "lower max_model_len, use a smaller dtype or a smaller draft") -> None:
    """parts: (label, bytes). Refuse before allocating if the sum exceeds what is free."""
    need = sum(b for _, b in parts)
    have = available_bytes(device)
    if need > have:
        detail = ", ".join(f"{label} {b / 2**30:.2f} GiB" for label, b in parts)
        raise InsufficientMemoryError(
            f"need about {need / 2**30:.2f} GiB ({detail}) but only {have / 2**30:.2f} GiB is available on "
            f"{device}; {advice}"
        )
