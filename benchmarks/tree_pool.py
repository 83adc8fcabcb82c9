"""Which nodes of an EAGLE draft tree are worth verifying, measured offline on the trees the shipped head grows.

The head grows a large pool per step (EAGLE-2's setting: depth 6, 10 nodes a level, top-8 expansion); the
target's greedy continuation then says which pool nodes it would have accepted (a node counts if its whole path
matches). Any rule that picks a subtree of the pool can be scored without running the target again:
accepted tokens = the correct nodes it kept. Scored here, for n verified nodes:

- `wW`: a tree grown W nodes a level (top-4 expansion; w10 as logged, top-8), then its n nodes of highest
  cumulative draft probability (EAGLE-2's re-ranking); w1 is the head's argmax chain;
- `oracle`: the correct path itself (an upper bound no rule reaches).

Tokens per second follow from the engine's own measured forward costs (verify n + 1 tokens) and a measured head
level of m nodes. Requests: ones the target writes itself (`heads/written.py`, seeds past the 2,400 the shipped
head was trained on), so no evaluation set is read and the head has not seen them.

    python benchmarks/tree_pool.py --requests 48 --max-tokens 128 --out bench-out/tree-pool
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from itertools import pairwise
from pathlib import Path

import torch

from specdecode.tree import MAX_TREE_NODES

TARGET = "qwen2.5-coder-1.5b-instruct"
SAVED = Path(__file__).resolve().parents[1] / "data/head-training" / TARGET / "written-requests-2400.jsonl"
SEEN = 2400  # seeds the shipped head's training answered


def unseen_requests(llm, n: int, out: Path) -> list[str]:  # noqa: ANN001 - an LLM
    """n cleaned requests of seeds >= SEEN (written now, cached in out)."""
    from specdecode.heads.written import clean_written_request, written_requests

    count = SEEN + 2 * n  # about 2% of replies are dropped by the cleaner; twice as many seeds is plenty
    written_requests(llm, count, out, batch=16, reuse=[SAVED])
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    fresh = sorted((r for r in rows if r["seed"] >= SEEN), key=lambda r: r["seed"])
    cleaned = [clean_written_request(r["prompt"], r["reply"]) for r in fresh]
    return [c for c in dict.fromkeys(cleaned) if c][:n]


def record_pools(llm, prompts: list[list[int]], max_tokens: int) -> list[dict]:  # noqa: ANN001
    """Greedy generation with the pool of every step kept whole (no pruning); per step the context length, the
    pool's tokens, parents and cumulative log-probabilities."""
    from specdecode.proposers.base import Draft
    from specdecode.proposers.eagle_rows import EagleRows
    from specdecode.proposers.tree_growth import TreeGrower
    from specdecode.sampling import SamplingParams

    steps: list[dict] = []
    context = {"L": 0}

    def keep_all(self: TreeGrower) -> Draft:  # the grown pool, recorded and verified whole
        steps.append({"L": context["L"], "tokens": list(self.tokens), "parents": list(self.parents),
                      "scores": list(self.scores)})
        return Draft(list(self.tokens), None, list(self.parents))

    original_propose = EagleRows.propose

    def propose(self, asks):  # noqa: ANN001 - one request at a time: one row
        context["L"] = len(asks[0].seq.token_ids)
        return original_propose(self, asks)

    TreeGrower.draft = keep_all
    EagleRows.propose = propose
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    runs = []
    for ids in prompts:
        first = len(steps)
        out = llm.generate([ids], params)[0]
        runs.append({"full": list(ids) + list(out.token_ids), "steps": steps[first:]})
    return runs


def node_depths(parents: list[int]) -> list[int]:
    depth = [0]
    for p in parents:
        depth.append(depth[p] + 1)
    return depth[1:]


def correct_nodes(step: dict, full: list[int]) -> list[bool]:
    """Node i is correct when its path equals the target's continuation after the context."""
    ok = [True]  # the root
    for tok, par, d in zip(step["tokens"], step["parents"], node_depths(step["parents"]), strict=True):
        pos = step["L"] + d - 1
        ok.append(ok[par] and pos < len(full) and full[pos] == tok)
    return ok[1:]


def top_order(step: dict, width: int = 10, branching: int = 8) -> list[int]:
    """The pool a tree of `width` nodes a level and top-`branching` expansion would have grown (approximately:
    from the logged pool), in order of cumulative draft probability."""
    scores, parents = step["scores"], step["parents"]
    kept, frontier = [], [0]
    while frontier:
        cands = []
        for node in frontier:
            kids = sorted((i for i, p in enumerate(parents) if p == node), key=lambda i: -scores[i])
            cands += kids[:branching]
        frontier = [i + 1 for i in sorted(cands, key=lambda i: -scores[i])[:width]]
        kept += [i - 1 for i in frontier]
    return sorted(kept, key=lambda i: (-scores[i], i))


def accepted(order: list[int], n: int, ok: list[bool]) -> int:
    return sum(ok[i] for i in order[:n])


def value_chosen(steps: list, orders: list[list[int]], draft_s: float, verify: dict[int, float]) -> dict:  # noqa: ANN001
    """The engine's own rule (proposers/nodes_worth_verifying.py: TreeValue, learned calibration, one per request)
    applied to each step's pool: mean nodes kept, τ and tokens per second."""
    from specdecode.proposers.nodes_worth_verifying import TreeValue

    value, kept, tokens, seconds, last_l = None, 0, 0.0, 0.0, None
    for (s, ok), order in zip(steps, orders, strict=True):
        if value is None or s["L"] < last_l:  # a new request
            value = TreeValue(lambda t: verify[t])
        last_l = s["L"]
        n = value.keep([math.exp(s["scores"][i]) for i in order], draft_s)
        got = accepted(order, n, ok)
        value.observe(got)
        kept += n
        tokens += 1 + got
        seconds += draft_s + verify[n + 1]
    return {"nodes": kept / len(steps), "tau": tokens / len(steps), "tok_s": tokens / seconds}


def head_level_seconds(llm, widths: list[int]) -> dict[int, float]:  # noqa: ANN001
    """Median seconds of one head level over m nodes (forward + draft logits + top-8), for each m."""
    head = llm.head
    cache = head.new_cache(llm.max_model_len + MAX_TREE_NODES)
    out = {}
    with torch.inference_mode():
        for m in widths:
            feats = torch.zeros(1, m, head.config.hidden_size, dtype=head.dtype)
            toks = torch.zeros(1, m, dtype=torch.long)
            samples = []
            for i in range(7):
                t0 = time.perf_counter()
                h = head(feats, toks, torch.full((1, m), i), cache)
                torch.log_softmax(head.draft_logits(h[0]).float(), -1).topk(8)
                samples.append(time.perf_counter() - t0)
                cache.reset()
            out[m] = statistics.median(samples[1:])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-nodes", type=int, default=16)
    ap.add_argument("--out", type=Path, default=Path("bench-out/tree-pool"))
    args = ap.parse_args()
    from specdecode import LLM
    from specdecode.heads.shipped import shipped_head

    args.out.mkdir(parents=True, exist_ok=True)
    llm = LLM(TARGET, speculative_config={
        "method": "eagle", "model": str(shipped_head(TARGET, "eagle")), "num_speculative_tokens": 6,
        "draft_tree_width": 10, "draft_tree_branching": 8, "draft_prompt_lookup": False})
    cost = llm.measure_cost(llm.engine.proposer, 1)  # a fixed k skips it at start-up; it prices the rules below
    pool_file = args.out / "pools.json"
    if pool_file.exists():
        runs = json.loads(pool_file.read_text())
    else:
        requests = unseen_requests(llm, args.requests, args.out / "written-requests.jsonl")
        prompts = [llm.chat_prompt_ids([{"role": "user", "content": r}]) for r in requests]
        t0 = time.perf_counter()
        runs = record_pools(llm, prompts, args.max_tokens)
        print(f"{len(runs)} requests, {sum(len(r['steps']) for r in runs)} steps in {time.perf_counter() - t0:.0f} s")
        pool_file.write_text(json.dumps(runs))
    verify = {t: cost.target_forward_seconds(t) for t in range(1, MAX_TREE_NODES + 2)}  # any tree + its root
    level = head_level_seconds(llm, [1, 2, 4, 10])
    steps = [(s, correct_nodes(s, r["full"])) for r in runs for s in r["steps"]]
    widths = (1, 2, 4, 10)
    orders = {w: [top_order(s, w, 4 if w < 10 else 8) for s, _ in steps] for w in widths}
    rows = []
    for n in range(1, args.max_nodes + 1):
        row = {"n": n, "verify_ms": 1000 * verify[n + 1]}
        for w in widths:  # a width-w tree: 6 head levels of w nodes, then its best n nodes verified
            got = [accepted(order, n, ok) for order, (_, ok) in zip(orders[w], steps, strict=True)]
            row[f"tau_w{w}"] = 1 + sum(got) / len(got)
            row[f"tok_s_w{w}"] = row[f"tau_w{w}"] / (6 * level[w] + verify[n + 1])
        row["tau_oracle"] = 1 + sum(min(n, sum(ok)) for _, ok in steps) / len(steps)
        rows.append(row)
    chosen = {w: value_chosen(steps, orders[w], 6 * level[w], verify) for w in widths}
    plain = 1 / verify[1]
    # calibration: accepted / predicted (sum of exp(score)) by depth and by draft-probability bucket
    by_depth: dict[int, list[float]] = {}
    edges = (0.0, 0.02, 0.05, 0.1, 0.2, 0.4, 0.7, 1.01)
    by_prob: dict[str, list[float]] = {f"{lo}-{hi}": [0.0, 0.0, 0] for lo, hi in pairwise(edges)}
    for s, ok in steps:
        for score, good, d in zip(s["scores"], ok, node_depths(s["parents"]), strict=True):
            p = math.exp(score)
            by_depth.setdefault(d, [0.0, 0.0])
            by_depth[d][0] += good
            by_depth[d][1] += p
            for lo, hi in pairwise(edges):
                if lo <= p < hi:
                    cell = by_prob[f"{lo}-{hi}"]
                    cell[0] += good
                    cell[1] += p
                    cell[2] += 1
    calibration = {"by_depth": {d: a / max(b, 1e-9) for d, (a, b) in sorted(by_depth.items())},
                   "by_prob": {k: {"accepted_rate": a / max(c, 1), "mean_prob": b / max(c, 1), "nodes": c}
                               for k, (a, b, c) in by_prob.items()}}
    summary = {"steps": len(steps), "requests": len(runs), "plain_tok_s": plain,
               "head_level_ms": {m: 1000 * s for m, s in level.items()}, "rows": rows,
               "pool_nodes_mean": statistics.mean(len(s["tokens"]) for s, _ in steps),
               "correct_nodes_mean": statistics.mean(sum(ok) for _, ok in steps), "calibration": calibration,
               "value_chosen": chosen}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"{len(steps)} steps; plain {plain:.2f} tok/s (decode step only); head level ms "
          + ", ".join(f"{m}: {1000 * s:.1f}" for m, s in level.items()))
    print("accepted / predicted by depth: " + ", ".join(f"{d}: {c:.2f}" for d, c in calibration["by_depth"].items()))
    print("by draft probability: " + ", ".join(f"{k}: {v['accepted_rate']:.3f} vs {v['mean_prob']:.3f} ({v['nodes']})"
                                              for k, v in calibration["by_prob"].items()))
    print("engine's rule (TreeValue) on each pool: " + "; ".join(
        f"w{w}: {c['nodes']:.1f} nodes, τ {c['tau']:.2f}, {c['tok_s']:.2f} tok/s" for w, c in chosen.items()))
    print("| n | verify ms | " + " | ".join(f"τ w{w}" for w in widths) + " | τ oracle | "
          + " | ".join(f"tok/s w{w}" for w in widths) + " |")
    print("|---:" * (3 + 2 * len(widths)) + "|")
    for r in rows:
        print(f"| {r['n']} | {r['verify_ms']:.0f} | " + " | ".join(f"{r[f'tau_w{w}']:.2f}" for w in widths)
              + f" | {r['tau_oracle']:.2f} | " + " | ".join(f"{r[f'tok_s_w{w}']:.2f}" for w in widths) + " |")


if __name__ == "__main__":
    main()
