"""Stage 1 of head training: run the target over training conversations and store what a head learns from — the
target's final-norm hidden state at every position (and, for a fused-feature head, the layers the target
captures), the token there, and the target's greedy next token — in safetensors shards. Shards are written
atomically and skipped when present, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from specdecode.heads.corpus import Messages, training_conversations
from specdecode.model.tokenizer import Tokenizer
from specdecode.model.transformer import Transformer

MAX_SEQ_TOKENS = 1024
"""Longer conversations are cut: the head's attention span in training, and the prefill cost."""
LOGIT_CHUNK = 128
"""Positions per output-matrix product when taking the target's argmax (bounds the [T, V] buffer)."""


def progress_bar(iterable=None, **kwargs) -> tqdm:  # noqa: ANN001 - tqdm's own signature
    """A progress bar that also leaves a trace in logs: redrawn live on a terminal, a line every 30 s
    otherwise (an hours-long job run with nohup still shows where it is)."""
    live = sys.stderr.isatty()
    return tqdm(iterable, mininterval=0.5 if live else 30.0, **kwargs)


@dataclass
class Shard:
    hidden: torch.Tensor  # [N, D] target final-norm hidden states (bf16)
    tokens: torch.Tensor  # [N] token at each position (int64)
    target_next: torch.Tensor  # [N] target's argmax next token after each position (int64)
    starts: torch.Tensor  # [S + 1] offsets of each conversation in the shard
    aux: torch.Tensor | None = None  # [N, k * D] the target's captured layers (Transformer.capture_layers), bf16

    def sequences(self) -> list[tuple[int, int]]:
        s = self.starts.tolist()
        return list(zip(s[:-1], s[1:], strict=True))


def load_shard(path: Path, aux: bool = True) -> Shard:
    """aux=False leaves the captured layers on disk (3x the final-norm features' size for EAGLE-3's three)."""
    with safe_open(str(path), framework="pt") as f:
        t = {name: f.get_tensor(name) for name in f.keys() if aux or name != "aux"}  # noqa: SIM118 - not a dict
    return Shard(t["hidden"], t["tokens"].long(), t["target_next"].long(), t["starts"].long(), t.get("aux"))


def conversation_ids(tokenizer: Tokenizer, messages: Messages) -> list[int]:
    text = tokenizer.hf.apply_chat_template(messages, tokenize=False)
    return list(tokenizer.hf.encode(text, add_special_tokens=False))[:MAX_SEQ_TOKENS]


@torch.inference_mode()
def target_features(target: Transformer, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Hidden [T, D], the target's argmax next token [T] and its captured layers [T, k * D] (None unless it
    captures some) over one sequence."""
    cache = target.new_cache(1, len(ids))
    tokens = torch.tensor([ids], device=target.device)
    positions = torch.arange(len(ids), device=target.device)[None]
    hidden = target(tokens, positions, cache)[0]  # [T, D]
    nxt = torch.cat([target.compute_logits(hidden[i : i + LOGIT_CHUNK]).argmax(-1)
                     for i in range(0, len(ids), LOGIT_CHUNK)])
    aux = None if target.captured is None else target.captured[0].cpu()
    return hidden.cpu(), nxt.cpu(), aux


def shard_paths(out_dir: Path) -> list[Path]:
    return sorted(out_dir.glob("shard-*.safetensors"))


def generate_features(
    target: Transformer,
    tokenizer: Tokenizer,
    out_dir: Path,
    num_tokens: int,
    shard_tokens: int = 8192,
    seed: int = 0,
    fingerprint: dict | None = None,
    conversations: list[Messages] | None = None,
    source: str = "corpus",
) -> list[Path]:
    """Write shards until num_tokens positions are stored (or the conversations run out); returns the
    shard paths. Resumable: the conversation order is fixed (by the seed for the built-in corpus) and
    a finished shard is never recomputed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    meta_path = out_dir / "features.json"
    meta = {"seed": seed, "shard_tokens": shard_tokens, "max_seq_tokens": MAX_SEQ_TOKENS, "target": fingerprint,
            "source": source}
    if target.capture_layers:
        meta["capture_layers"] = list(target.capture_layers)
    if meta_path.exists() and json.loads(meta_path.read_text()) != meta:
        raise ValueError(f"{out_dir} holds features made with other settings or another target; use a new --out")
    meta_path.write_text(json.dumps(meta, indent=1))

    convs = iter(conversations if conversations is not None else training_conversations(seed))
    num_shards = -(-num_tokens // shard_tokens)
    bar = progress_bar(total=num_shards * shard_tokens, unit="tok", desc="target features", smoothing=0.1)
    for index in range(num_shards):
        path = out_dir / f"shard-{index:05d}.safetensors"
        # Conversations are assigned to shards deterministically (greedy fill), so skipping a finished
        # shard means only re-tokenizing its conversations.
        batch: list[list[int]] = []
        total = 0
        while total < shard_tokens:
            msgs = next(convs, None)
            if msgs is None:
                break
            ids = conversation_ids(tokenizer, msgs)
            batch.append(ids)
            total += len(ids)
        if not batch:
            break
        if path.exists():
            bar.update(total)
            continue
        t0 = time.perf_counter()
        hiddens, nexts, auxes = [], [], []
        for ids in batch:
            h, n, aux = target_features(target, ids)
            hiddens.append(h.to(torch.bfloat16))
            nexts.append(n)
            if aux is not None:
                auxes.append(aux.to(torch.bfloat16))
            bar.update(len(ids))
        starts = torch.tensor([0, *torch.tensor([len(b) for b in batch]).cumsum(0).tolist()])
        tensors = {
            "hidden": torch.cat(hiddens).contiguous(),
            "tokens": torch.tensor([t for b in batch for t in b], dtype=torch.int32),
            "target_next": torch.cat(nexts).to(torch.int32),
            "starts": starts.to(torch.int64),
        }
        if auxes:
            tensors["aux"] = torch.cat(auxes).contiguous()
        tmp = path.with_suffix(".partial")
        save_file(tensors, str(tmp))
        tmp.rename(path)
        bar.set_postfix(shard=index, tok_s=f"{total / (time.perf_counter() - t0):.0f}")
    bar.close()
    return shard_paths(out_dir)
