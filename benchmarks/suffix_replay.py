"""Replay plain answers through the suffix proposer's draft sizing, without the model: a quick way to try a sizing
rule on a tuning set before a benchmark measures it.

Two rules: the engine's (k from the row's running acceptance, then at most one node per matched token) and one by
node chances (each trie node's share of the occurrences times the row's rate per drafted token for each level, and
the likeliest nodes that promise the most tokens per second over their forward), as suffix decoding's paper sizes
its trees.

A `specdecode bench` run of `plain@gguf` records every prompt's tokens and its greedy answer. Greedy verification
keeps a draft's longest path that the answer follows, so the steps a sizing rule takes are known exactly; their
time comes from the target's measured forward costs (`--costs`: a JSON list of seconds for a forward over 1, 2, ...
tokens, e.g. `LLM(...).cost.target_seconds`). Rounds work as in the benchmark: they take the prompts of every task
in turn (`--round-size` as the run's), and the store learns the earlier answers of the same round, whatever their
task. The ratio printed is plain's time over the rule's, prefill (from the records) included.

    python benchmarks/suffix_replay.py BENCH_OUT_DIR --costs COSTS.json [--tasks agent,repeated_format]
        [--history-prior]
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path

from specdecode.cost_model import CostModel
from specdecode.engine.adaptive import DEFAULT_PRIOR, AcceptanceTracker, choose_k
from specdecode.proposers.suffix import MIN_NODE_PROB, SPEC_FACTOR
from specdecode.proposers.suffix_index import SuffixStore
from specdecode.proposers.suffix_source import SuffixSource
from specdecode.proposers.suffix_trie import SuffixTree


class History:
    """The pooled acceptance of earlier rows, which the engine starts a new row from (engine/history.py)."""

    def __init__(self, pooled: bool) -> None:
        self.pooled, self.observed, self.accepted = pooled, 0, 0

    def prior(self) -> float:
        return self.accepted / self.observed if self.pooled and self.observed else DEFAULT_PRIOR


class Row:
    """What a row's sizing reads and learns: the policy's per-position acceptance and the lookup's one rate."""

    def __init__(self, history: History) -> None:
        self.history = history
        self.policy = AcceptanceTracker(history.prior())
        self.rate = AcceptanceTracker(history.prior(), per_position=False)

    def update(self, depth: int, kept: int) -> None:
        self.policy.update(depth, kept)
        self.rate.update(depth, kept)
        self.history.observed += min(depth, kept + 1)
        self.history.accepted += kept


Sizing = Callable[[SuffixSource, list[int], Row, CostModel, int], SuffixTree]


def by_running_acceptance(source: SuffixSource, context: list[int], row: Row, cost: CostModel,
                          k_max: int) -> SuffixTree:
    """k from the row's running acceptance, then at most one node per matched token (a fixed k's rule)."""
    k = choose_k(row.policy, cost, k_max)
    trie = source.trie(context, None, k)
    return trie.tree(min(k, math.ceil(SPEC_FACTOR * trie.match_length)), MIN_NODE_PROB)


def by_node_chances(source: SuffixSource, context: list[int], row: Row, cost: CostModel, k_max: int) -> SuffixTree:
    """The likeliest nodes (a node is never likelier than its parent) that promise the most tokens per second."""
    tree = source.trie(context, None, k_max).tree(k_max, MIN_NODE_PROB)
    depths = [0]
    for parent in tree.parents:
        depths.append(depths[parent] + 1)
    rate = row.rate.alpha(0)
    best_n, best_rate, total = 0, 1.0 / cost.target_forward_seconds(1), 1.0
    for n, (p, d) in enumerate(zip(tree.probs, depths[1:], strict=True), start=1):
        total += p * rate**d
        if total / cost.target_forward_seconds(n + 1) > best_rate * (1.0 + 1e-9):
            best_n, best_rate = n, total / cost.target_forward_seconds(n + 1)
    return SuffixTree(tree.tokens[:best_n], tree.parents[:best_n], tree.probs[:best_n])


SIZINGS: dict[str, Sizing] = {"running acceptance": by_running_acceptance, "node chances": by_node_chances}


def accepted_path(tree: SuffixTree, answer: list[int]) -> int:
    """Draft nodes greedy verification keeps: the longest path from the root that `answer` follows."""
    children: dict[int, dict[int, int]] = {}
    for i, (tok, parent) in enumerate(zip(tree.tokens, tree.parents, strict=True)):
        children.setdefault(parent, {})[tok] = i + 1
    node, kept = 0, 0
    while kept < len(answer) and answer[kept] in children.get(node, {}):
        node = children[node][answer[kept]]
        kept += 1
    return kept


def depth(tree: SuffixTree) -> int:
    depths = [0]
    for parent in tree.parents:
        depths.append(depths[parent] + 1)
    return max(depths)


def replay(prompt: list[int], answer: list[int], source: SuffixSource, cost: CostModel, k_max: int,
           sizing: Sizing, history: History) -> float:
    """Seconds of the decode steps (the prefill emits answer[0] and is the same for every rule)."""
    row, i, seconds = Row(history), 1, 0.0
    while i < len(answer):
        tree = sizing(source, prompt + answer[:i], row, cost, k_max)
        kept = accepted_path(tree, answer[i:])
        seconds += cost.target_forward_seconds(len(tree.tokens) + 1)
        row.update(depth(tree), kept)
        i += kept + 1
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bench_out", type=Path, help="a bench --out folder with a plain@gguf run")
    ap.add_argument("--costs", type=Path, required=True)
    ap.add_argument("--tasks", default="", help="comma-separated (default: every task of the run)")
    ap.add_argument("--k-max", type=int, default=16)
    ap.add_argument("--round-size", type=int, default=12)
    ap.add_argument("--history-prior", action="store_true",
                    help="a row starts from the pooled acceptance of the rule's earlier rows, as in the engine "
                         "(default: from DEFAULT_PRIOR)")
    args = ap.parse_args()
    cost = CostModel(tuple(json.loads(args.costs.read_text())))
    records = [json.loads(line) for line in (args.bench_out / "records.jsonl").read_text().splitlines()]
    prompts = json.loads((args.bench_out / "run-state.json").read_text())["prompt_ids"]
    plain = [r for r in records if r["method"].startswith("plain")]
    order = list(dict.fromkeys(r["task"] for r in plain))  # the dataset's task order: prompt_ids follow it
    offset = {t: sum(1 for r in plain if r["task"] in order[:i]) for i, t in enumerate(order)}
    tasks = [t for t in args.tasks.split(",") if t] or order
    # The harness's rounds: prompts of every task in turn (index, then task order), each round a freshly loaded
    # engine whose store starts empty and learns every answer of the round, whatever its task.
    rank = {t: i for i, t in enumerate(order)}
    turn = sorted(plain, key=lambda r: (r["prompt_index"], rank[r["task"]]))
    rounds = [turn[i:i + args.round_size] for i in range(0, len(turn), args.round_size)]
    for name, sizing in SIZINGS.items():
        history = History(args.history_prior)
        seconds = dict.fromkeys(tasks, 0.0)
        plain_seconds = dict.fromkeys(tasks, 0.0)
        for rows in rounds:
            source = SuffixSource(2, SuffixStore())
            for r in rows:
                task = r["task"]
                prompt, answer = prompts[offset[task] + r["prompt_index"]], r["token_ids"]
                if task in seconds:
                    seconds[task] += r["prefill_seconds"] + replay(prompt, answer, source, cost, args.k_max, sizing,
                                                                   history)
                    plain_seconds[task] += r["prefill_seconds"] + (len(answer) - 1) * cost.target_forward_seconds(1)
                source.remember(None, prompt + answer, len(prompt))
        print(f"{name:>20}: " + "  ".join(f"{t} {plain_seconds[t] / seconds[t]:.3f}x" for t in tasks))


if __name__ == "__main__":
    main()
