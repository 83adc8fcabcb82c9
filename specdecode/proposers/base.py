"""What every proposer offers the engine: declared capabilities, `configure`, `begin`, `propose`, `on_verified`.

The engine talks to a `BatchProposer`: one object for every row of the batch, whose `propose` is one call for
all rows (the lookups n-gram's `NgramRows` and suffix decoding's `SuffixRows`, both `LookupRows`; the draft
model's `DraftModelRows`, EAGLE's `EagleRows`, Medusa's `MedusaRows`).
Each keeps its rows' drafting state in a dict keyed by the row's key. The engine never probes a proposer's
attributes: what it may do is declared in `Capabilities`, its costs come from `step_cost_hint` /
`catch_up_token_seconds`, and the memory its rows hold from `state_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from specdecode.sampling import SamplingParams

if TYPE_CHECKING:
    from specdecode.cost_model import CostModel
    from specdecode.structured.matcher import TokenMatcher


@dataclass
class SequenceView:
    """The read-only facts about one sequence a proposer may use.

    `token_ids` holds prompt + output; the target has processed all but the last one.
    """

    token_ids: list[int]
    prompt_len: int
    params: SamplingParams
    generator: torch.Generator
    output_counts: torch.Tensor | None = None  # [V] occurrences in the output, only with penalties
    prompt_mask: torch.Tensor | None = None  # [V] bool, only with penalties
    matcher: TokenMatcher | None = None
    """Structured outputs: the grammar's cursor after token_ids (a drafter may consume along its draft and
    must roll back what it consumed)."""
    tenant: str | None = None
    """Whose earlier answers a lookup may read ("key" scope): the request's cache_salt."""


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    probs: torch.Tensor | None = None
    """[k, V] processed draft probabilities, or None for a point mass (n-gram, greedy draft)."""
    parents: list[int] | None = None
    """For a tree: parent of each draft token as a tree index (0 = the pending token, j+1 = tokens[j]);
    None for a chain. Tree children are deterministic candidates (point masses)."""

    @property
    def is_tree(self) -> bool:
        return self.parents is not None

    def first(self, n: int) -> Draft:
        """The first n nodes: a tree's parents come before their children, so they form a tree too (a sampled
        chain keeps the probs of its first n)."""
        return Draft(self.tokens[:n], None if self.probs is None else self.probs[:n],
                     None if self.parents is None else self.parents[:n])

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class Capabilities:
    """What a proposer does, declared once (the engine reads nothing else about it)."""

    tree_width: int = 1
    """Nodes kept per tree level: 1 drafts chains, 0 a tree sized by the node budget, w > 1 a tree of width w."""
    target_hidden: bool = False
    """Reads the target's hidden states of the positions the engine keeps (`observe_hidden`)."""
    catch_up: bool = False
    """Feeds context it has not seen before drafting (a draft model's prefill), at `catch_up_token_seconds`
    per token; `catch_up_tokens` says how many."""
    lookup: bool = False
    """Its drafts are lookups themselves (n-gram, suffix): the engine offers no lookup guess beside them."""

    @property
    def trees(self) -> bool:
        return self.tree_width != 1


@dataclass
class ProposeRow:
    """One row's request to the batch proposer in a step."""

    key: int
    """The row's proposer state (given to `begin`)."""
    seq: SequenceView
    k: int
    """Draft length (tree depth); rows with k = 0 are not passed."""
    node_budget: int
    """Tree nodes this row may verify (from the batch's cost; ignored by chain proposers)."""


class BatchProposer(Protocol):
    """The engine's proposer: every row's drafting state, one `propose` call per step for all rows."""

    name: str
    capabilities: Capabilities

    def configure(self, cost: CostModel) -> None:
        """The engine's measured cost model (what verifying t tokens costs), once it has one."""

    def reserve(self, rows: int) -> None:
        """Allocate the drafting state of `rows` rows now (a server's rows up front; `generate` grows on
        demand), so no admission pays for an allocation."""

    def begin(self, key: int, seq: SequenceView) -> None:
        """Row `key` starts a sequence (prompt known, nothing generated)."""

    def release(self, key: int) -> None:
        """Row `key` is done: its drafting state is freed for a later row."""

    def propose(self, rows: list[ProposeRow]) -> list[Draft]:
        """Each row's draft of up to k tokens (a tree of depth k, of about node_budget nodes) continuing its
        seq.token_ids; one draft per row, in order."""

    def observe_hidden(self, key: int, hidden: torch.Tensor) -> None:
        """The target's features [m, D] of row `key`'s next m kept positions (capabilities.target_hidden)."""

    def on_verified(self, key: int, seq: SequenceView, num_accepted: int, own_accepted: int) -> None:
        """Row `key`'s last draft had num_accepted tokens kept (own_accepted of them drafted by this proposer,
        not a grafted lookup guess); seq.token_ids already holds the step's output."""

    def catch_up_tokens(self, key: int, seq: SequenceView) -> int:
        """Tokens row `key` must feed before drafting (capabilities.catch_up; 0 otherwise)."""

    def step_cost_hint(self) -> float:
        """Seconds per drafted token (0 for free proposers); measured once."""

    def catch_up_token_seconds(self) -> float:
        """Seconds per token of a catch-up forward (capabilities.catch_up; 0 otherwise)."""

    def state_bytes(self, rows: int) -> int:
        """Bytes of the drafting state `rows` rows hold once allocated (caches, the target's features), for
        memory checks before allocating and for the benchmark's report."""


class LookupRows:
    """The stateless part of a `BatchProposer` whose drafts are lookups (n-gram, suffix): it reads no model and
    holds no row state, so nothing is fed, measured or allocated and drafting is free. Subclasses give `name`
    and `propose`."""

    name: str
    capabilities = Capabilities(lookup=True)

    def configure(self, cost: CostModel) -> None:
        pass

    def reserve(self, rows: int) -> None:
        pass

    def begin(self, key: int, seq: SequenceView) -> None:
        pass

    def release(self, key: int) -> None:
        pass

    def observe_hidden(self, key: int, hidden: torch.Tensor) -> None:
        pass

    def on_verified(self, key: int, seq: SequenceView, num_accepted: int, own_accepted: int) -> None:
        pass

    def catch_up_tokens(self, key: int, seq: SequenceView) -> int:
        return 0

    def step_cost_hint(self) -> float:
        return 0.0

    def catch_up_token_seconds(self) -> float:
        return 0.0

    def state_bytes(self, rows: int) -> int:
        return 0
