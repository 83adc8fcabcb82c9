"""Stage 2 of head training: fit an EAGLE head or Medusa heads to the stored target features.

EAGLE (pair j = feature j + token j+1 -> feature j+1): smooth-L1 regression on the target's next
feature plus 0.1 x cross-entropy against the target's greedy next token, with small uniform noise on
the input features so the head tolerates its own imperfect predictions while drafting (as in EAGLE).
A fused-feature head (EAGLE-3 style) reads the target's captured layers through its `fuse` linear at the
first step and its own predictions after it, so it needs `unroll_steps` >= 2 to learn the second kind.
Medusa (feature t -> token t+2+i for head i): cross-entropy against the target's greedy tokens.

Checkpoints (weights, optimizer, step, RNG, the rest of the shuffled pass) are written every
`checkpoint_every` steps and at the end; a rerun with the same output directory resumes from the last one
and ends with the weights an uninterrupted run reaches.

Each run records the loss on a fixed batch (the first `EVAL_WINDOWS` windows, fixed feature noise) at its
start and end: unlike the per-step losses of shuffled batches, it compares runs and steps directly.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specdecode.heads.features import Shard, load_shard, progress_bar
from specdecode.heads.modules import DraftHead, EagleHead, MedusaHeads
from specdecode.heads.persist import load_head, new_head, save_head
from specdecode.heads.vocab import choose_draft_vocab, widen_draft_vocab
from specdecode.model.transformer import Transformer

CHECKPOINT = "checkpoint.pt"
EVAL_WINDOWS = 16


@dataclass
class TrainOptions:
    kind: str = "eagle"
    epochs: float = 4.0
    window: int = 256
    """Positions per training sequence (a window of one conversation)."""
    batch_windows: int = 4
    lr: float = 1e-3
    warmup_steps: int = 30
    draft_vocab_size: int = 32768
    draft_vocab_first: int = 0
    """Also give the tokenizer's lowest ids [0, N) output rows (see heads/vocab.py); a fine-tuned head's
    vocabulary is widened the same way."""
    intermediate_size: int | None = None
    num_medusa_heads: int = 4
    feature_noise: float = 0.1
    """Uniform noise amplitude on input features, relative to their standard deviation."""
    ce_weight: float = 0.1
    distill: str = "hard"
    """EAGLE: the token loss's target: "hard" = the target's greedy token (cross-entropy), "soft" = the target's
    whole distribution over the draft vocabulary (softmax of its output rows at its own next feature, as
    EAGLE-1's classification loss): the ranking of the runner-up tokens is what a tree's siblings draw on."""
    reg_weight: float = 1.0
    """EAGLE: weight of the feature regression (EAGLE-3 drops it: 0 trains on the tokens alone)."""
    feature_layers: list[int] | None = None
    """EAGLE: the target layers a fused-feature head reads (HeadConfig.feature_layers); None = those of
    `init_from` (none for a new head). The shards must hold those layers (`Shard.aux`)."""
    unroll_steps: int = 1
    """EAGLE: training steps that feed the head its own predicted features (1 = teacher forcing only). Drafting
    past the first token reads the head's own predictions, so later steps train it on them; they pay most as
    fine-tuning of a head already trained with teacher forcing (docs/heads.md)."""
    normalize_regression: bool = False
    """EAGLE: regress features scaled per dimension by their spread in the data."""
    budget_minutes: float | None = None
    max_steps: int | None = None
    """Stop (resumably) after this many steps in total."""
    checkpoint_every: int = 50
    seed: int = 0
    init_from: str | None = None
    """A saved head of the same kind to start from (fine-tuning): its weights, draft vocabulary and sizes."""


@dataclass
class Corpus:
    hidden: torch.Tensor  # [N, D] bf16
    tokens: torch.Tensor  # [N]
    target_next: torch.Tensor  # [N]
    windows: list[tuple[int, int]]  # [start, end) ranges inside one conversation
    aux: torch.Tensor | None = None  # [N, k * D] bf16: the target's captured layers, if the shards hold them

    @property
    def inputs(self) -> torch.Tensor:
        """What the head reads of the target at each position: [N, k * D] captured layers, else [N, D]."""
        return self.hidden if self.aux is None else self.aux

    @classmethod
    def from_shards(cls, paths: list[Path], window: int, fused: bool = False) -> Corpus:
        """fused: keep the shards' captured layers (a fused-feature head's input); else only the final-norm
        features (shards with captured layers serve both kinds of head)."""
        shards: list[Shard] = [load_shard(p, aux=fused) for p in paths]
        if fused and any(s.aux is None for s in shards):
            raise ValueError("a fused-feature head needs the target's captured layers in every feature shard: "
                             "generate features with those layers")
        aux = torch.cat([s.aux for s in shards]) if fused else None  # type: ignore[misc]
        hidden = torch.cat([s.hidden for s in shards])
        tokens = torch.cat([s.tokens for s in shards])
        target_next = torch.cat([s.target_next for s in shards])
        windows, offset = [], 0
        for s in shards:
            for a, b in s.sequences():
                for w in range(a, b - 2, window):
                    windows.append((offset + w, offset + min(b, w + window + 1)))  # +1: the shifted target
            offset += len(s.tokens)
        return cls(hidden, tokens, target_next, windows, aux)


def window_batch(corpus: Corpus, picks: list[tuple[int, int]]) -> tuple[torch.Tensor, ...]:
    """Pad windows to one length: features, tokens, next features, labels, mask."""
    length = max(b - a for a, b in picks) - 1
    d = corpus.hidden.shape[1]
    inputs = corpus.inputs
    feats = torch.zeros(len(picks), length, inputs.shape[1])
    toks = torch.zeros(len(picks), length, dtype=torch.long)
    nxt_feats = torch.zeros(len(picks), length, d)
    labels = torch.zeros(len(picks), length, dtype=torch.long)
    mask = torch.zeros(len(picks), length, dtype=torch.bool)
    for row, (a, b) in enumerate(picks):
        n = b - a - 1
        feats[row, :n] = inputs[a : b - 1].float()
        toks[row, :n] = corpus.tokens[a + 1 : b]
        nxt_feats[row, :n] = corpus.hidden[a + 1 : b].float()
        labels[row, :n] = corpus.target_next[a + 1 : b]
        mask[row, :n] = True
    return feats, toks, nxt_feats, labels, mask


def _eagle_step_loss(head: EagleHead, pred: torch.Tensor, nxt_feats: torch.Tensor, labels: torch.Tensor,
                     mask: torch.Tensor, t2d: torch.Tensor, opts: TrainOptions,
                     feature_scale: torch.Tensor) -> tuple[torch.Tensor, float, float, float]:
    """Loss of predicted features [B, T, D] against the target's: (loss, reg, ce, top-1)."""
    # Per-dimension scaling: a few massive-activation dimensions would otherwise own the regression.
    reg = F.smooth_l1_loss(pred[mask] / feature_scale, nxt_feats[mask] / feature_scale)
    logits = head.draft_logits(pred[mask])  # [M, Vd]
    target_cls = t2d[labels[mask]]  # -1 where the target's token is outside the draft vocabulary
    keep = target_cls >= 0
    if opts.distill == "soft":
        with torch.no_grad():  # the target's own logits over the draft vocabulary, from its next feature
            soft = torch.softmax(head.draft_logits(nxt_feats[mask]), -1)  # [M, Vd]
        ce = -(soft * torch.log_softmax(logits, -1)).sum(-1).mean()
    else:
        ce = (F.cross_entropy(logits, target_cls.clamp(min=0), reduction="none") * keep).sum() / keep.sum().clamp(min=1)
    acc = ((logits.argmax(-1) == target_cls) & keep).float().mean()
    return opts.reg_weight * reg + opts.ce_weight * ce, reg.item(), ce.item(), acc.item()


def eagle_loss(head: EagleHead, batch: tuple[torch.Tensor, ...], t2d: torch.Tensor, opts: TrainOptions,
               gen: torch.Generator, feature_scale: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """Step 1 on the target's (noisy) features; each further unrolled step feeds the previous step's
    predictions back as features, as drafting does (the head learns to continue from its own guesses)."""
    feats, toks, nxt_feats, labels, mask = batch
    feats = head.input_features(feats)  # [B, T, D] (a fused head's fuse over the captured layers)
    scale = feats[mask].std().detach()
    noisy = feats + (torch.rand(feats.shape, generator=gen) - 0.5) * 2 * opts.feature_noise * scale
    positions = torch.arange(feats.shape[1])[None].expand(feats.shape[0], -1)
    pred = head(noisy, toks, positions)  # [B, T, D]: predicted feature j+1 from (feature j, token j+1)
    total, reg, ce, top1 = _eagle_step_loss(head, pred, nxt_feats, labels, mask, t2d, opts, feature_scale)
    stats = {"reg": reg, "ce": ce, "top1": top1}
    for k in range(1, opts.unroll_steps):
        if pred.shape[1] <= 1:
            break
        # (predicted feature j+k, token j+k+1) at position j+k -> feature j+k+1
        pred = head(pred[:, :-1], toks[:, 1:], positions[:, k:])
        toks, nxt_feats, labels, mask = toks[:, 1:], nxt_feats[:, 1:], labels[:, 1:], mask[:, 1:]
        loss_k, _, ce_k, top1_k = _eagle_step_loss(head, pred, nxt_feats, labels, mask, t2d, opts, feature_scale)
        total = total + loss_k
        stats[f"top1_step{k + 1}"] = top1_k
        stats[f"ce_step{k + 1}"] = ce_k
    return total, stats


def medusa_loss(head: MedusaHeads, batch: tuple[torch.Tensor, ...], t2d: torch.Tensor, opts: TrainOptions,
                gen: torch.Generator, feature_scale: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    feats, _, _, labels, mask = batch  # labels[:, j] = target's token after position j + 1
    total = torch.zeros(())
    stats: dict[str, float] = {}
    outs = head(feats)  # [K, B, T, D]
    for i in range(outs.shape[0]):
        # Head i on feature t guesses the target's token after position t + 1 + i = labels[:, t + i].
        valid = mask[:, i:] & mask[:, : mask.shape[1] - i]
        logits = head.draft_logits(outs[i][:, : mask.shape[1] - i][valid])
        cls = t2d[labels[:, i:][valid]]
        keep = cls >= 0
        ce = (F.cross_entropy(logits, cls.clamp(min=0), reduction="none") * keep).sum() / keep.sum().clamp(min=1)
        total = total + ce * (0.8**i)  # nearer heads matter more (their tokens are reached more often)
        stats[f"top1_{i}"] = ((logits.argmax(-1) == cls) & keep).float().mean().item()
    return total, stats


def fixed_batch_loss(head: DraftHead, corpus: Corpus, t2d: torch.Tensor, opts: TrainOptions,
                     feature_scale: torch.Tensor, autocast: bool) -> float:
    """Mean training loss over the first EVAL_WINDOWS windows with feature noise from a fixed seed; touches
    neither the weights nor the training's random state."""
    loss_fn = eagle_loss if opts.kind == "eagle" else medusa_loss
    gen = torch.Generator().manual_seed(0)
    windows = corpus.windows[:EVAL_WINDOWS]
    total = 0.0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        for i in range(0, len(windows), opts.batch_windows):
            picks = windows[i : i + opts.batch_windows]
            loss, _ = loss_fn(head, window_batch(corpus, picks), t2d, opts, gen, feature_scale)  # type: ignore[arg-type]
            total += loss.item() * len(picks)
    return total / max(1, len(windows))


def _mean(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]} if rows else {}


def train_head(target: Transformer, shard_files: list[Path], out_dir: Path, opts: TrainOptions,
               always_ids: list[int], data_info: dict | None = None) -> DraftHead:
    """Train (or resume training) a head on the stored features; saves the head in out_dir."""
    torch.manual_seed(opts.seed)
    vocab = target.config.vocab_size
    ckpt_path = out_dir / CHECKPOINT
    ckpt = torch.load(ckpt_path, weights_only=False) if ckpt_path.exists() else None
    init = load_head(opts.init_from, target, kind=opts.kind, dtype=torch.float32) if opts.init_from else None
    sizes = init.config if init is not None else None  # a fine-tuned head keeps its starting head's shape
    layers = opts.feature_layers if opts.feature_layers is not None else (sizes.feature_layers if sizes else [])
    if layers and opts.kind != "eagle":
        raise ValueError("feature layers are for EAGLE heads")
    corpus = Corpus.from_shards(shard_files, opts.window, fused=bool(layers))
    width = len(layers) * target.config.hidden_size if layers else target.config.hidden_size
    if corpus.inputs.shape[1] != width:
        raise ValueError(f"the feature shards hold {corpus.inputs.shape[1]} numbers a position but a head reading "
                         f"layers {layers} needs {width}: generate features with those layers")
    if ckpt:
        d2t = ckpt["d2t"]
    elif init is not None:
        d2t = widen_draft_vocab(init.d2t, opts.draft_vocab_first, vocab)
    else:
        d2t = choose_draft_vocab(corpus.target_next, vocab, opts.draft_vocab_size, always_ids, opts.draft_vocab_first)
    # A fine-tuned head's record keeps the chain of runs behind it (each one's options, steps and data).
    init_training = dict(init.config.training) if init is not None and init.config.training else None
    head = new_head(target, opts.kind, d2t, sizes.intermediate_size if sizes else opts.intermediate_size,
                    sizes.num_medusa_heads if sizes else opts.num_medusa_heads, opts.seed, layers).float()
    if init is not None and not ckpt:
        # A head that starts fusing layers (or fuses others) learns its `fuse` from scratch.
        state = {k: v.float() for k, v in init.saved_state().items()
                 if k != "d2t" and not (k.startswith("fuse.") and layers != sizes.feature_layers)}  # type: ignore[union-attr]
        head.load_state_dict(state, strict=False)
    del init
    head.lm_head.weight.data = head.lm_head.weight.data.float()
    t2d = torch.full((vocab,), -1, dtype=torch.long)
    t2d[d2t] = torch.arange(len(d2t))
    params = [p for n, p in head.named_parameters() if p.requires_grad and not n.startswith("lm_head")]
    opt = torch.optim.AdamW(params, lr=opts.lr, weight_decay=0.0, betas=(0.9, 0.95))
    steps_per_epoch = max(1, len(corpus.windows) // opts.batch_windows)
    total_steps = max(1, int(opts.epochs * steps_per_epoch))
    step = resumed_from = 0
    rng = random.Random(opts.seed)
    gen = torch.Generator().manual_seed(opts.seed)
    if ckpt:
        head.load_state_dict(ckpt["head"], strict=False)
        opt.load_state_dict(ckpt["optimizer"])
        step = resumed_from = ckpt["step"]
        rng.setstate(ckpt["rng"])
        gen.set_state(ckpt["gen"])
    order: list[tuple[int, int]] = [tuple(w) for w in ckpt.get("order", [])] if ckpt else []  # type: ignore[misc]

    def lr_at(s: int) -> float:  # linear warm-up, cosine decay to 10%
        if s < opts.warmup_steps:
            return opts.lr * (s + 1) / opts.warmup_steps
        frac = (s - opts.warmup_steps) / max(1, total_steps - opts.warmup_steps)
        return opts.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))

    def save_checkpoint() -> None:
        tmp = ckpt_path.with_suffix(".partial")
        torch.save({"head": head.saved_state(), "optimizer": opt.state_dict(), "step": step, "d2t": d2t,
                    "rng": rng.getstate(), "gen": gen.get_state(), "order": order}, tmp)
        tmp.rename(ckpt_path)

    out_dir.mkdir(parents=True, exist_ok=True)
    loss_fn = eagle_loss if opts.kind == "eagle" else medusa_loss
    # Per-dimension spread of the target's features (a sample of positions is plenty).
    sample = corpus.hidden[:: max(1, len(corpus.hidden) // 20000)].float()
    feature_scale = sample.std(0).clamp(min=1e-3) if opts.normalize_regression else torch.ones(sample.shape[1])
    autocast = target.device.type == "cpu"
    eval_start = fixed_batch_loss(head, corpus, t2d, opts, feature_scale, autocast)
    started = time.monotonic()
    bar = progress_bar(total=total_steps, initial=step, desc=f"train {opts.kind} head", unit="step")
    last: dict[str, float] = {}
    history: list[dict[str, float]] = []  # this run's per-step losses (the summary uses the first/last 20)
    head.train()
    while step < total_steps:
        if opts.budget_minutes is not None and time.monotonic() - started > 60 * opts.budget_minutes:
            break
        if opts.max_steps is not None and step >= opts.max_steps:
            break
        if not order:  # a fresh shuffled pass; the RNG state is in the checkpoint
            order = corpus.windows[:]
            rng.shuffle(order)
        picks, order = order[: opts.batch_windows], order[opts.batch_windows :]
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss, last = loss_fn(head, window_batch(corpus, picks), t2d, opts, gen, feature_scale)  # type: ignore[arg-type]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        history.append({"loss": loss.item(), **last})
        bar.update(1)
        bar.set_postfix(loss=f"{history[-1]['loss']:.3f}", **{k: f"{v:.3f}" for k, v in last.items()})
        if step % opts.checkpoint_every == 0:
            save_checkpoint()
    bar.close()
    save_checkpoint()
    eval_end = fixed_batch_loss(head, corpus, t2d, opts, feature_scale, autocast)
    head.eval()
    head.config.training = {
        "steps": step, "total_steps": total_steps, "resumed_from": resumed_from, "windows": len(corpus.windows),
        "positions": int(corpus.tokens.numel()), "options": {k: v for k, v in vars(opts).items()},
        "first_steps": _mean(history[:20]), "last_steps": _mean(history[-20:]), "data": data_info or {},
        "fixed_batch_loss": {"windows": min(EVAL_WINDOWS, len(corpus.windows)), "start": eval_start, "end": eval_end},
    }
    if init_training:
        head.config.training["init_from_training"] = init_training
    save_head(head, out_dir, dtype=torch.bfloat16)  # the checkpoint keeps fp32 for resuming
    (out_dir / "training.json").write_text(json.dumps(head.config.training, indent=1))
    return head
