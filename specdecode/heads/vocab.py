"""A head's draft vocabulary: which target ids get an output row (`d2t`), and widening a saved head's.

The full output matrix would dominate a head's cost on a CPU, so a head scores a subset of the target's
ids: those the target predicted most often in the head's training data. That data is narrow (code-heavy
here), so common words of other text fall outside it: on 60 Spec-Bench prompts 14-27% of the target's
answer tokens outside math lay beyond the shipped head's 32,768 ids, where no draft can match them.
Byte-level BPE numbers its tokens in merge order, the most frequent pieces of the tokenizer's own broad
corpus first, so its lowest ids are those common words; `first_ids` adds them. The head predicts the
target's feature and scores it with the target's own output rows, so ids join a trained head's vocabulary
without retraining (`widen_head`). Each row costs drafting time, though: the shipped head widened by the
32,768 lowest ids (53k rows) ran Spec-Bench 60 5% faster at equal τ but HumanEval 5% slower, and the full
vocabulary lowered τ (docs/heads.md); so it is opt-in (train-head --draft-vocab-first).

    python -m specdecode.heads.vocab SRC_HEAD_DIR DST_HEAD_DIR --first-ids 32768
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from specdecode.heads.persist import WEIGHTS, read_head_config, write_head_files


def choose_draft_vocab(target_next: torch.Tensor, vocab_size: int, size: int, always: list[int],
                       first_ids: int = 0) -> torch.Tensor:
    """The `size` ids the target most often predicts (plus `always`, e.g. EOS, and the tokenizer's
    `first_ids` lowest ids), sorted: [Vd]."""
    counts = torch.bincount(target_next, minlength=vocab_size).float()
    counts[always] = float("inf")
    size = min(size, vocab_size)
    return widen_draft_vocab(counts.topk(size).indices, first_ids, vocab_size)


def widen_draft_vocab(d2t: torch.Tensor, first_ids: int, vocab_size: int) -> torch.Tensor:
    """d2t [Vd] plus ids [0, first_ids) of a vocab_size-id target, sorted and without repeats: [Vd']."""
    if first_ids < 0:
        raise ValueError(f"first_ids must be >= 0, got {first_ids}")
    low = torch.arange(min(first_ids, vocab_size), dtype=torch.long)
    return torch.unique(torch.cat([d2t.long().cpu(), low]))  # unique() sorts


def widen_head(src: Path, dst: Path, first_ids: int) -> int:
    """Copy the head in `src` to `dst` with its draft vocabulary widened; returns the new vocabulary size.
    Only `d2t` and the config change: the output rows are the target's, rebuilt at load."""
    cfg = read_head_config(src)
    state = load_file(str(src / WEIGHTS))
    vocab_size = int(cfg.target.get("vocab_size", 0))
    if vocab_size <= 0:
        raise ValueError(f"{src}: the head's target fingerprint has no vocab_size")
    before = int(state["d2t"].numel())
    state["d2t"] = widen_draft_vocab(state["d2t"], first_ids, vocab_size).contiguous()
    cfg.draft_vocab_size = int(state["d2t"].numel())
    cfg.training = {**cfg.training, "widened_draft_vocab": {"first_ids": first_ids, "from": before,
                                                             "to": cfg.draft_vocab_size}}
    write_head_files(state, cfg, dst)
    (dst / "training.json").write_text(json.dumps(cfg.training, indent=1))  # as train_head writes it
    return cfg.draft_vocab_size


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specdecode.heads.vocab",
                                description="widen a saved head's draft vocabulary with the tokenizer's lowest ids")
    p.add_argument("src", type=Path, help="a saved head directory")
    p.add_argument("dst", type=Path, help="where to write the widened head (may equal src)")
    p.add_argument("--first-ids", type=int, default=32768, help="add ids [0, N) (default 32768)")
    args = p.parse_args(argv)
    size = widen_head(args.src, args.dst, args.first_ids)
    print(f"{args.dst}: draft vocabulary of {size} ids")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
