"""Teacher-forced top-1 of an EAGLE head on stored target features: the shards it was trained on against
conversations it never saw (from the same corpus, past the part the training used). A large gap means
the head overfits its data rather than lacking capacity.

    python benchmarks/head_accuracy.py [--head DIR] [--train-shards 4] [--held-out 30]

The held-out features are computed here (the target's prefill, ~1-2 min for 30 conversations on 2
cores) into --held-out-dir; no evaluation set of shared/data is read.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch

from specdecode.heads.corpus import training_conversations
from specdecode.heads.features import conversation_ids, generate_features, shard_paths
from specdecode.heads.fingerprint import target_fingerprint
from specdecode.heads.persist import load_head
from specdecode.heads.shipped import shipped_head
from specdecode.heads.train import Corpus, TrainOptions, eagle_loss, window_batch
from specdecode.model.load import load_model
from specdecode.train_cli import default_data_dir

TARGET = "qwen2.5-coder-1.5b-instruct"


@torch.no_grad()
def top1(head, shards: list[Path], windows: int, steps: int = 1) -> dict[str, float]:  # noqa: ANN001 - EagleHead
    """Mean top-1 over `windows` random windows of the shards, no input noise: "top1" on the target's features
    (teacher-forced), "top1_step2".. on the head's own predicted features of the steps before (as drafting)."""
    corpus = Corpus.from_shards(shards, window=256, fused=bool(head.config.feature_layers))
    picks = random.Random(0).sample(corpus.windows, min(windows, len(corpus.windows)))
    t2d = torch.full((head.target_vocab_size,), -1, dtype=torch.long)
    t2d[head.d2t] = torch.arange(len(head.d2t))
    opts = TrainOptions(feature_noise=0.0, unroll_steps=steps)
    rows = [eagle_loss(head, window_batch(corpus, [w]), t2d, opts, torch.Generator(), torch.ones(1))[1]
            for w in picks]
    return {k: sum(r[k] for r in rows) / len(rows) for k in rows[0] if k.startswith("top1")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head", type=Path, default=None, help="EAGLE head directory (default: the shipped one)")
    ap.add_argument("--train-shards", type=int, default=4, help="training shards to score (the first N)")
    ap.add_argument("--held-out", type=int, default=30, help="conversations from the end of the corpus")
    ap.add_argument("--held-out-dir", type=Path, default=Path("bench-out/head-held-out"))
    ap.add_argument("--windows", type=int, default=40)
    args = ap.parse_args()
    loaded = load_model(TARGET, "bf16")
    target = loaded.model
    convs = training_conversations(0)[-args.held_out :]  # training used the first ~1000 of ~2300
    tokens = sum(len(conversation_ids(loaded.tokenizer, c)) for c in convs)
    held = generate_features(target, loaded.tokenizer, args.held_out_dir, tokens,
                             fingerprint=target_fingerprint(target), conversations=convs,
                             source="held-out (end of the corpus)")
    head = load_head(args.head or shipped_head(TARGET, "eagle"), target, kind="eagle").float()
    train = shard_paths(default_data_dir(TARGET))[: args.train_shards]
    print("| shards | windows | teacher-forced top-1 |\n|---|---:|---:|")
    rows = [(f"training (first {len(train)} corpus shards)", train),
            (f"held out (last {args.held_out} corpus conversations)", held)]
    for name, shards in rows:
        print(f"| {name} | {args.windows} | {top1(head, shards, args.windows)['top1']:.3f} |")


if __name__ == "__main__":
    main()
