"""How wide a dynamic draft tree grows, and why: the verified nodes are re-ranked from what was grown."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from specdecode import LLM
from specdecode.engine.schedule import node_budget
from specdecode.proposers.tree_growth import MIN_DYNAMIC_WIDTH, TreeLevel, grow_tree, level_width, priced_nodes
from specdecode.tree.buffers import MAX_TREE_NODES


def test_level_width_configured_and_dynamic() -> None:
    assert level_width(3, 8, 6) == 3  # a configured width stays
    assert level_width(1, 8, 6) == 1  # a chain was asked for
    assert level_width(0, 8, 2) == 4  # the budget spread over the depth
    assert level_width(0, 64, 2) == 16  # at most 16 a level
    assert level_width(0, 8, 6) == MIN_DYNAMIC_WIDTH == 2  # never a chain: nothing to re-rank


def _logits(probs: dict[int, float], vocab: int = 8) -> torch.Tensor:
    rest = (1.0 - sum(probs.values())) / (vocab - len(probs))
    return torch.tensor([math.log(probs.get(i, rest)) for i in range(vocab)])


def test_a_dynamic_tree_can_keep_the_runner_up_branch() -> None:
    """Root: token 1 at 0.5, token 2 at 0.4. After 1 the head is unsure (best 0.3); after 2 it is sure (0.95).
    Keeping the best 3 nodes of a width-2 tree gives 1 (0.5), 2 (0.4) and 2 -> 5 (0.38), not 1 -> 3 (0.15): a
    budget of one node a level would have grown only the chain 1 -> 3, which cannot offer that."""
    after = {1: _logits({3: 0.3, 4: 0.3}), 2: _logits({5: 0.95})}

    def expand(level: TreeLevel) -> torch.Tensor:
        return torch.stack([after[int(t)] if int(t) in after else _logits({}) for t in level.tokens])

    width = level_width(0, 2, 2)
    draft = grow_tree(_logits({1: 0.5, 2: 0.4}), 2, width, 2, 1, expand, select=lambda probs: 3)
    assert sorted(draft.tokens) == [1, 2, 5]  # both root children and the runner-up's sure continuation
    assert draft.parents[draft.tokens.index(5)] == draft.tokens.index(2) + 1  # 5 hangs under 2 (1-based)
    assert draft.parents[draft.tokens.index(1)] == draft.parents[draft.tokens.index(2)] == 0


def test_priced_nodes_charge_what_is_verified() -> None:
    assert [priced_nodes(1, 8, k) for k in (1, 4, 6)] == [1, 4, 6]  # a chain verifies every drafted node
    # dynamic, budget 8: grown 8, 8, 6, 8, 10, 12 -> the pruned tree verifies about the budget
    assert [priced_nodes(0, 8, k) for k in range(1, 7)] == [8, 8, 6, 8, 8, 8]
    assert priced_nodes(0, 4, 6) == 6  # a deep tree keeps at least one whole path
    assert priced_nodes(3, 64, 6) == 18  # a small configured tree is charged what it grows


def test_flat_verify_cost_sizes_the_tree_as_on_a_gpu(tiny_llama_dir: Path, tiny_llama_other_dir: Path) -> None:
    """--flat-verify-cost (bench): every forward priced as one token, so a dynamic tree gets the whole budget."""
    spec = {"method": "draft", "model": str(tiny_llama_other_dir), "draft_tree_width": 0}
    llm = LLM(str(tiny_llama_dir), dtype="fp32", speculative_config=spec)
    cost = llm.measure_cost(llm.engine.proposer, 1, flat=True)
    assert len(set(cost.target_seconds)) == 1 and len(cost.target_seconds) == MAX_TREE_NODES + 1
    llm.engine.cost = cost
    assert node_budget(cost, llm.engine.k_max, 1) == MAX_TREE_NODES
    assert node_budget(cost, llm.engine.k_max, 8) == MAX_TREE_NODES  # flat: a batch affords it as well
    row_cost = llm.engine.row_cost
    assert row_cost is not None and row_cost.tree_nodes[-1] == MAX_TREE_NODES  # charged its full budget
