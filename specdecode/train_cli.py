"""`specdecode train-head`: target features (stage 1, resumable) then head training (stage 2, resumable)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from specdecode.cli_args import add_threads_arg

DEFAULT_DATA_TOKENS = 163840


def add_train_head_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train-head", help="train an EAGLE head or Medusa heads for a target model")
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct", help="target model (alias, .gguf or HF dir)")
    p.add_argument("--kind", choices=["eagle", "medusa"], default="eagle")
    p.add_argument("--out", required=True, type=Path, help="directory for the head (and its checkpoint)")
    p.add_argument("--data-dir", type=Path, default=None,
                   help="where target features are stored (default: $SPECDECODE_HOME/head-data/<target>)")
    p.add_argument("--data-tokens", type=int, default=DEFAULT_DATA_TOKENS,
                   help="positions of target features to generate (default %(default)s, ~25 min on 2 cores)")
    p.add_argument("--self-distill", type=int, default=0, metavar="N",
                   help="also train on the target's own answers to N requests built from the corpus (greedy, "
                        "256 tokens each; cached and resumable)")
    p.add_argument("--self-distill-draft", default=None,
                   help="draft model that speeds up generating those answers (default: n-gram lookup)")
    p.add_argument("--self-distill-diverse", type=int, default=0, metavar="N",
                   help="also train on the target's own answers to N diverse requests: translation, word problems, "
                        "explanations, advice, letters, summaries, passage questions (selfgen.diverse_requests); "
                        "combines with --self-distill")
    p.add_argument("--self-distill-written", type=int, default=0, metavar="N",
                   help="also train on the target's answers to N requests it writes itself (sampled, one seed each: "
                        "creative writing, role-play, reasoning, math, science, history, search questions, advice, "
                        "extraction, comparisons, texts to translate into English; heads.written)")
    p.add_argument("--self-distill-batch", type=int, default=1, metavar="B",
                   help="answer B requests at once with continuous batching (plain decoding, no draft)")
    p.add_argument("--self-distill-quantization", choices=["none", "int8-dynamic"], default="none",
                   help="the target's format while answering (features always come from the bf16 target)")
    p.add_argument("--data-only", action="store_true", help="generate the training data, then stop")
    p.add_argument("--epochs", type=float, default=4.0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--draft-vocab", type=int, default=32768, help="output rows of the head (most frequent ids)")
    p.add_argument("--draft-vocab-first", type=int, default=0, metavar="N",
                   help="also give the tokenizer's lowest N ids output rows (its most frequent pieces: common words "
                        "the training data lacks; default 0 = none; widens an --init-from head's too)")
    p.add_argument("--intermediate-size", type=int, default=None, help="EAGLE MLP width (default 2 x hidden)")
    p.add_argument("--num-heads", type=int, default=4, help="Medusa heads")
    p.add_argument("--unroll-steps", type=int, default=1,
                   help="EAGLE: training steps that feed the head its own predicted features (default 1)")
    p.add_argument("--ce-weight", type=float, default=0.1,
                   help="EAGLE: weight of the token cross-entropy against the feature regression (default 0.1, "
                        "EAGLE-1's)")
    p.add_argument("--distill", choices=("hard", "soft"), default="hard",
                   help="EAGLE: token loss against the target's greedy token (hard, default) or its whole "
                        "distribution over the draft vocabulary (soft, as EAGLE-1)")
    p.add_argument("--reg-weight", type=float, default=1.0,
                   help="EAGLE: weight of the feature regression (default 1; EAGLE-3 trains on tokens alone: 0)")
    p.add_argument("--feature-layers", default=None, metavar="LAYERS",
                   help="EAGLE-3 style fused features: the head reads the target's residual stream entering these "
                        "layers (comma-separated, or 'eagle3' = layers 2, L/2, L-3) instead of its final-norm hidden "
                        "state; features are stored apart (data dir /layers-...), ~3x the disk. Default: those of "
                        "--init-from, else none. Train with --unroll-steps >= 2")
    p.add_argument("--normalize-regression", action="store_true",
                   help="EAGLE: scale the feature regression per dimension by its spread in the data")
    p.add_argument("--init-from", type=Path, default=None, metavar="HEAD_DIR",
                   help="fine-tune this saved head (same kind and target) instead of starting from random weights; "
                        "its sizes and draft vocabulary are kept (the latter widened by --draft-vocab-first)")
    p.add_argument("--budget-minutes", type=float, default=None, help="stop training after this long (resumable)")
    add_threads_arg(p)
    p.set_defaults(func=run_train_head)


def default_data_dir(target: str) -> Path:
    from specdecode.fetch import models_home

    return models_home() / "head-data" / _data_name(target)


def _data_name(target: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(target).name)


SAVED_TEXTS = Path(__file__).resolve().parents[2] / "data" / "head-training"
"""Texts the target wrote in earlier runs (its requests and answers, JSONL), kept with the repository: making
them takes hours on 2 cores, and the cache does not outlive a machine. Features are always recomputed."""


def seed_data_dir(data_dir: Path, target: str, saved: Path = SAVED_TEXTS) -> list[Path]:
    """Copy the saved texts of this target that the data directory lacks; the stages that read them resume
    from what is there. Returns the files copied."""
    import shutil

    source = saved / _data_name(target)
    if not source.is_dir():
        return []
    data_dir.mkdir(parents=True, exist_ok=True)
    copied = []
    for path in sorted(source.glob("*.jsonl")):
        if not (data_dir / path.name).exists():
            shutil.copyfile(path, data_dir / path.name)
            copied.append(data_dir / path.name)
    return copied


def feature_dir(data_dir: Path, layers: list[int]) -> Path:
    """Where the features live: a fused-feature head's (captured layers too) apart from the others'."""
    return data_dir / ("layers-" + "-".join(map(str, layers))) if layers else data_dir


def _self_distilled_shards(args: argparse.Namespace, data_dir: Path, layers: list[int], fingerprint: dict,
                           request_sets: dict[str, list[str]]) -> list[Path]:
    """The target's answers to each set of requests (cached in self-answers-<tag>.jsonl; a diverse set is
    followed by back-translations of its translations, tag <tag>-back), then their features (self-<tag>, in
    feature_dir)."""
    import gc

    from specdecode import LLM
    from specdecode.heads.features import conversation_ids, generate_features
    from specdecode.heads.selfgen import back_translation_requests, self_distilled_conversations
    from specdecode.heads.written import written_requests
    from specdecode.model.fast_linear import convert_linears, target_linear_format
    from specdecode.model.load import load_model

    batch = args.self_distill_batch
    if batch > 1:
        spec = None  # under a full batch, speculation backs off anyway
    else:
        spec = {"method": "draft", "model": args.self_distill_draft} if args.self_distill_draft else {"method": "ngram"}
    llm = LLM(args.target, speculative_config=spec, quantization=args.self_distill_quantization, max_model_len=4096)
    if args.self_distill_written > 0:  # the target writes these requests first (cached, resumable)
        n = args.self_distill_written
        out = data_dir / f"written-requests-{n}.jsonl"
        others = sorted(set(data_dir.glob("written-requests-*.jsonl")) - {out})  # same seeds: copied, not rewritten
        request_sets[f"written-{n}"] = written_requests(llm, n, out, batch=batch, reuse=others)
    answered: dict[str, list] = {}
    for tag, requests in request_sets.items():
        out = data_dir / f"self-answers-{tag}.jsonl"
        kind = tag.split("-")[0]
        diverse = kind == "diverse"
        # A larger diverse or written set starts from the answers of other sets of its kind (copied where the
        # request is the same).
        reuse = [p for p in data_dir.glob(f"self-answers-{kind}-*.jsonl")
                 if p != out and not p.stem.endswith("-back")] if kind in ("diverse", "written") else []
        answered[tag] = self_distilled_conversations(llm, requests, out, batch=batch, reuse=reuse)
        if diverse and (back := back_translation_requests(answered[tag])):
            answered[f"{tag}-back"] = self_distilled_conversations(
                llm, back, data_dir / f"self-answers-{tag}-back.jsonl", batch=batch)
    if args.self_distill_quantization == "none":  # the answering target is the bf16 one: reuse it
        target, tokenizer = llm.target.model, llm.tokenizer
        del llm
    else:  # features come from the target as it is, whatever answered
        del llm
        gc.collect()
        loaded = load_model(args.target, "bf16")
        target, tokenizer = loaded.model, loaded.tokenizer
        del loaded
        convert_linears(target, target_linear_format("none", target.dtype, target.device))
    shards: list[Path] = []
    target.capture_layers = tuple(layers)
    for tag, convs in answered.items():
        total = sum(len(conversation_ids(tokenizer, c)) for c in convs)
        shards += generate_features(target, tokenizer, feature_dir(data_dir, layers) / f"self-{tag}", total,
                                    fingerprint=fingerprint,
                                    conversations=convs, source="self-distilled")
    del target, tokenizer
    gc.collect()  # free the answering engine (or the reloaded target) before training loads its own
    return shards


def run_train_head(args: argparse.Namespace) -> int:
    from specdecode.heads.config import parse_feature_layers
    from specdecode.heads.features import generate_features
    from specdecode.heads.fingerprint import target_fingerprint
    from specdecode.heads.persist import read_head_config
    from specdecode.heads.selfgen import diverse_requests, self_distill_requests
    from specdecode.heads.train import TrainOptions, train_head
    from specdecode.model.fast_linear import convert_linears, target_linear_format
    from specdecode.model.load import load_model

    data_dir = args.data_dir or default_data_dir(args.target)
    for path in seed_data_dir(data_dir, args.target):
        print(f"using the repository's saved texts: {path}")
    loaded = load_model(args.target, "bf16")
    fingerprint = target_fingerprint(loaded.model)
    tok = loaded.tokenizer
    if args.feature_layers is not None:
        layers = parse_feature_layers(args.feature_layers, loaded.model.config.num_layers)
    else:
        layers = read_head_config(args.init_from).feature_layers if args.init_from else []
    loaded.model.capture_layers = tuple(layers)
    # Stage 1 runs the target in its fast format; stage 2 needs the plain output matrix, so it reloads.
    convert_linears(loaded.model, target_linear_format("none", loaded.model.dtype, loaded.model.device))
    shards = generate_features(loaded.model, tok, feature_dir(data_dir, layers), args.data_tokens,
                               fingerprint=fingerprint)
    del loaded
    request_sets = {}
    if args.self_distill > 0:
        request_sets[str(args.self_distill)] = self_distill_requests(args.self_distill)
    if args.self_distill_diverse > 0:
        request_sets[f"diverse-{args.self_distill_diverse}"] = diverse_requests(args.self_distill_diverse)
    if request_sets or args.self_distill_written > 0:
        shards += _self_distilled_shards(args, data_dir, layers, fingerprint, request_sets)
    if args.data_only:
        print(f"{len(shards)} shards of training data in {data_dir}")
        return 0
    target = load_model(args.target, "bf16").model
    opts = TrainOptions(kind=args.kind, epochs=args.epochs, lr=args.lr, draft_vocab_size=args.draft_vocab,
                        draft_vocab_first=args.draft_vocab_first,
                        intermediate_size=args.intermediate_size, num_medusa_heads=args.num_heads,
                        budget_minutes=args.budget_minutes, unroll_steps=args.unroll_steps,
                        normalize_regression=args.normalize_regression, ce_weight=args.ce_weight, distill=args.distill,
                        reg_weight=args.reg_weight, feature_layers=layers,
                        init_from=str(args.init_from) if args.init_from else None)
    always = [i for i in (tok.eos_token_id, tok.hf.convert_tokens_to_ids("<|im_end|>")) if isinstance(i, int)]
    always = [i for i in always if 0 <= i < target.config.vocab_size]
    head = train_head(target, shards, args.out, opts, always,
                      data_info={"dir": str(data_dir), "shards": len(shards), "target": args.target})
    done = head.config.training
    state = "finished" if done["steps"] >= done["total_steps"] else "stopped (rerun the command to resume)"
    print(f"{args.kind} head {state} after {done['steps']}/{done['total_steps']} steps: {args.out}")
    print(f'use it with --speculative-config \'{{"method": "{args.kind}", "model": "{args.out}"}}\'')
    return 0
