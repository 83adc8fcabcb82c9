"""Fault isolation per row: an error in one row's proposal, grammar or sampling fails that request alone.

A step's phases run over every row at once. A row whose own part of a phase raises (its proposal, its grammar
matcher, its sampling, its tokens' bookkeeping) finishes with finish_reason "error" (`Sequence.fail`: the
message stays on the sequence, the traceback goes to the log), does nothing for the rest of the step (its
nodes ride the forward and are ignored) and leaves the batch with the step's finished rows. The other rows
never see it: their drafts, masks, verdicts and tokens are computed as if it were not there.

The proposal is the one phase that is a single call for every row (`BatchProposer.propose`). When that call
raises, or returns a draft the engine cannot run, each row is retried alone, from where it stood before the
call: its random generator is put back (a sampled draft draws from the request's own generator) and its
drafting state brought back to its committed tokens with `on_verified` and nothing kept, what a wholly
rejected draft does (the failed call may have fed the draft model's cache, say, past the sequence). A row whose
retry fails too fails; the others take their solo drafts, which the batch proposers draft for a row in any
batch (up to the float rounding of a wider forward), so their outputs stay those they have alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

from specdecode.engine.sequence import Sequence
from specdecode.proposers.base import BatchProposer, Draft, ProposeRow

logger = logging.getLogger(__name__)

T = TypeVar("T")


def fail_row(seq: Sequence, what: str, exc: BaseException) -> None:
    """Finish the request with an error that names the part of the step that raised."""
    logger.error("request %s failed in %s; the other requests go on", seq.request_id, what, exc_info=exc)
    seq.fail(f"internal error in {what}: {type(exc).__name__}: {exc}")


def guarded(seq: Sequence, what: str, fn: Callable[..., T], *args: Any) -> T | None:
    """fn(*args) for one row; None when it raises, and then that row's request fails alone."""
    try:
        return fn(*args)
    except Exception as exc:
        fail_row(seq, what, exc)
        return None


def check_drafts(drafts: list[Draft], asks: list[ProposeRow], vocab: int) -> None:
    """Raise ValueError unless there is one draft per row, every token an id below `vocab` and every tree node's
    parent before it: a bad draft would otherwise fail the whole batch's forward."""
    if len(drafts) != len(asks):
        raise ValueError(f"the proposer returned {len(drafts)} drafts for {len(asks)} rows")
    for draft in drafts:
        bad = [t for t in draft.tokens if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"drafted token ids outside the vocabulary of {vocab}: {bad[:4]}")
        parents = draft.parents
        if parents is not None and (len(parents) != len(draft.tokens)
                                    or any(not 0 <= p <= j for j, p in enumerate(parents))):
            raise ValueError(f"a draft tree's parents must name earlier nodes, got {parents[:16]}")


def propose_rows(proposer: BatchProposer, asks: list[ProposeRow], seqs: dict[int, Sequence], vocab: int
                 ) -> list[Draft]:
    """Every row's draft from one batched call; where it fails, each row's draft from a call of its own (a row
    whose own call fails gets an empty draft and its request fails). `seqs`: each row's sequence by its key."""
    if not asks:
        return []
    saved = {a.key: a.seq.generator.get_state() for a in asks if not a.seq.params.greedy}
    try:
        drafts = proposer.propose(asks)
        check_drafts(drafts, asks, vocab)
        return drafts
    except Exception as exc:
        if len(asks) == 1:
            fail_row(seqs[asks[0].key], "the proposal", exc)
            return [Draft()]
        logger.warning("the proposal of %d rows failed (%s: %s); proposing for each row alone", len(asks),
                       type(exc).__name__, exc)
    out = []
    for ask in asks:
        if ask.key in saved:
            ask.seq.generator.set_state(saved[ask.key])
        draft = guarded(seqs[ask.key], "the proposal", _propose_alone, proposer, ask, vocab)
        out.append(Draft() if draft is None else draft)
    return out


def _propose_alone(proposer: BatchProposer, ask: ProposeRow, vocab: int) -> Draft:
    proposer.on_verified(ask.key, ask.seq, 0, 0)  # nothing of the failed call's drafts is kept
    drafts = proposer.propose([ask])
    check_drafts(drafts, [ask], vocab)
    return drafts[0]
