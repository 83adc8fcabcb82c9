"""Does an EAGLE head learn more from the target's fused low/middle/high layers (EAGLE-3) than from its
final-norm hidden state? Both heads train from scratch on the same corpus positions with the same options and
steps; the table gives their top-1 on conversations neither saw, teacher-forced (step 1) and on their own
predicted features (steps 2 and 3, as drafting uses them). With --init-from both start from a trained head
(the fused one learns only its fuse from scratch): does turning the shipped head into a fused one pay?
--variants picks the heads compared: final (final-norm features), fused (the captured layers), soft (final-norm,
token loss against the target's whole distribution: train-head --distill soft), fused-soft.

    python benchmarks/fused_features.py [--layers eagle3] [--tokens 32768] [--steps 150] [--out bench-out/fused]
    python benchmarks/fused_features.py --variants final,soft ...

The features (~9 min for 32k positions on 2 AMD cores) hold both the final-norm states and the captured layers,
so one pass serves both heads; every stage resumes. Corpus conversations only (the training corpus of
`train-head`); no evaluation set of shared/data is read.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

from head_accuracy import TARGET, top1

from specdecode.heads.config import parse_feature_layers
from specdecode.heads.corpus import training_conversations
from specdecode.heads.features import conversation_ids, generate_features
from specdecode.heads.fingerprint import target_fingerprint
from specdecode.heads.persist import load_head
from specdecode.heads.shipped import shipped_head
from specdecode.heads.train import Corpus, TrainOptions, train_head
from specdecode.model.fast_linear import convert_linears, target_linear_format
from specdecode.model.load import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="eagle3", help="the fused head's layers (as train-head --feature-layers)")
    ap.add_argument("--tokens", type=int, default=32768, help="training positions (from the corpus' start)")
    ap.add_argument("--held-out", type=int, default=30, help="conversations from the end of the corpus")
    ap.add_argument("--steps", type=int, default=150, help="training steps of each head (4 windows of 256)")
    ap.add_argument("--unroll-steps", type=int, default=2)
    ap.add_argument("--ce-weight", type=float, default=0.5)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--windows", type=int, default=60, help="held-out windows scored")
    ap.add_argument("--init-from", default=None, metavar="HEAD_DIR",
                    help="start both heads from this final-norm head ('shipped': the shipped one; the fused head "
                         "learns its fuse from scratch) and also score it as it is")
    ap.add_argument("--variants", default="final,fused", help="heads to train: final, fused, soft, fused-soft")
    ap.add_argument("--out", type=Path, default=Path("bench-out/fused"))
    args = ap.parse_args()

    loaded = load_model(TARGET, "bf16")
    target, tok = loaded.model, loaded.tokenizer
    layers = parse_feature_layers(args.layers, target.config.num_layers)
    fp = target_fingerprint(target)
    convert_linears(target, target_linear_format("none", target.dtype, target.device))  # fast prefill
    target.capture_layers = tuple(layers)
    t0 = time.perf_counter()
    train = generate_features(target, tok, args.out / "train", args.tokens, fingerprint=fp)
    convs = training_conversations(0)[-args.held_out :]  # training takes the corpus' first conversations
    held = generate_features(target, tok, args.out / "held-out", sum(len(conversation_ids(tok, c)) for c in convs),
                             fingerprint=fp, conversations=convs, source="held-out (end of the corpus)")
    features_s = time.perf_counter() - t0
    del loaded, target
    gc.collect()
    target = load_model(TARGET, "bf16").model  # training reads the plain output matrix
    always = [i for i in (tok.eos_token_id, tok.hf.convert_tokens_to_ids("<|im_end|>")) if isinstance(i, int)]
    windows = len(Corpus.from_shards(train, 256).windows)
    epochs = args.steps * TrainOptions.batch_windows / windows  # the schedule ends at --steps
    init = str(shipped_head(TARGET, "eagle")) if args.init_from == "shipped" else args.init_from
    saved = args.out / "results.json"  # earlier runs' heads stay on record: a variant scored before is not rerun
    results = json.loads(saved.read_text()) if saved.exists() else {}
    if init:
        head = load_head(init, target, kind="eagle").float()
        results[f"{args.init_from} as it is"] = {"held_out": top1(head, held, args.windows, steps=3),
                                                 "trained_on": top1(head, train, args.windows // 2)["top1"],
                                                 "train_s": 0.0}
    names = {"final": "final-norm", "fused": f"fused {layers}", "soft": "final-norm, soft labels",
             "fused-soft": f"fused {layers}, soft labels"}
    for variant in args.variants.split(","):
        name, fused = names[variant], layers if variant.startswith("fused") else []
        if name in results:
            continue
        opts = TrainOptions(kind="eagle", epochs=epochs, lr=args.lr, max_steps=args.steps,
                            unroll_steps=args.unroll_steps, ce_weight=args.ce_weight, feature_layers=fused,
                            distill="soft" if variant.endswith("soft") else "hard", init_from=init)
        out = args.out / f"head-{variant}"
        t1 = time.perf_counter()
        train_head(target, train, out, opts, always)
        train_s = time.perf_counter() - t1
        head = load_head(out, target, kind="eagle").float()
        results[name] = {"held_out": top1(head, held, args.windows, steps=3),
                         "trained_on": top1(head, train, args.windows // 2, steps=1)["top1"], "train_s": train_s}
    saved.write_text(json.dumps(results, indent=1))
    print(f"features: {args.tokens} training positions + {args.held_out} held-out conversations in {features_s:.0f} s")
    print("| head input | held-out top-1 step 1 | step 2 | step 3 | top-1 on its training data | train s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        h = r["held_out"]
        print(f"| {name} | {h['top1']:.3f} | {h['top1_step2']:.3f} | {h['top1_step3']:.3f} | {r['trained_on']:.3f} "
              f"| {r['train_s']:.0f} |")


if __name__ == "__main__":
    main()
