"""The engine's batch proposer for a speculative config: which class drafts, over which model or head.

`LLM` loads the weights (the draft model, or a head attached to the target) and asks `proposer_factory` for a
function of the rows an engine runs at most, so `generate`'s engine and every server engine get drafting states
of their own over the same weights.
"""

from __future__ import annotations

from collections.abc import Callable

from specdecode.config import SpeculativeConfig
from specdecode.heads.modules import DraftHead, EagleHead, MedusaHeads
from specdecode.model.transformer import Transformer
from specdecode.proposers.base import BatchProposer
from specdecode.proposers.cross_vocab_rows import CrossVocabDraftRows
from specdecode.proposers.draft_rows import DraftModelRows
from specdecode.proposers.eagle_rows import EagleRows
from specdecode.proposers.medusa_rows import MedusaRows
from specdecode.proposers.ngram import NgramRows
from specdecode.proposers.suffix import SuffixRows
from specdecode.proposers.suffix_index import SuffixStore
from specdecode.proposers.suffix_source import SuffixSource
from specdecode.proposers.text_bridge import TextBridge

ProposerFactory = Callable[[int], BatchProposer]
"""max rows -> a batch proposer with its own drafting states."""


def lookup_source(spec: SpeculativeConfig | None) -> SuffixSource | None:
    """The suffix source of the `suffix` proposer and of the lookup guesses beside a drafter, over a store of
    earlier answers in the config's scope; None where nothing reads it (no speculation, the n-gram proposer, a
    drafter with its guesses off)."""
    if spec is None or spec.method == "ngram" or (spec.method != "suffix" and not spec.draft_prompt_lookup):
        return None
    return SuffixSource(spec.prompt_lookup_min, SuffixStore(spec.suffix_scope, spec.suffix_cache_tokens))


def proposer_factory(spec: SpeculativeConfig | None, max_len: int, draft: Transformer | None = None,
                     draft_vocab: tuple[int, int] | None = None, head: DraftHead | None = None,
                     lookup: SuffixSource | None = None, bridge: TextBridge | None = None
                     ) -> ProposerFactory | None:
    """The factory of batch proposers for `spec` (None without speculation). `draft`: the loaded draft model of
    the "draft" method, drafting over the target's ids (`draft_vocab`: its real and the target's row counts when
    they differ); `head`: the EAGLE or Medusa head attached to the target; `max_len`: the context length;
    `lookup`: the suffix source (`lookup_source`), which the suffix proposer drafts from and a draft model's
    chains guess with; `bridge`: the draft's tokenizer differs from the target's and drafts cross as text."""
    if spec is None:
        return None
    width, branching = spec.tree_width, spec.tree_branching
    if spec.method == "draft":
        assert draft is not None, "the draft method needs its loaded draft model"
        if bridge is not None:
            return lambda rows: CrossVocabDraftRows(draft, max_len, bridge, lookup, max_rows=rows)
        return lambda rows: DraftModelRows(draft, max_len, width, branching, lookup, vocab=draft_vocab,
                                           max_rows=rows)
    if isinstance(head, EagleHead):
        return lambda rows: EagleRows(head, max_len, width, branching, max_rows=rows)
    if isinstance(head, MedusaHeads):
        return lambda rows: MedusaRows(head, width, branching)
    if spec.method == "suffix":
        assert lookup is not None, "the suffix method needs its suffix source"
        return lambda rows: SuffixRows(lookup)
    lo, hi = spec.prompt_lookup_min, spec.prompt_lookup_max
    return lambda rows: NgramRows(lo, hi)
