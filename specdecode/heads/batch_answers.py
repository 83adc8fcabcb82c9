"""One loop that answers many prompts for head training data, one at a time (with the LLM's proposer) or
`batch` at once with continuous batching, handing each answer to `save` as it finishes."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

from specdecode.heads.features import progress_bar
from specdecode.sampling import SamplingParams

Job = tuple[Hashable, list[int], SamplingParams]
"""(key, prompt token ids, sampling) of one prompt."""


def cached_rows(path: Path) -> list[Any]:
    """The JSON lines a cache file of answers holds (none if it is missing); a line cut short by a kill
    mid-write is skipped, so its prompt is answered again."""
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def answer_all(llm, jobs: list[Job], save: Callable[[Hashable, str], None], batch: int = 1,  # noqa: ANN001
               desc: str = "target answers", unit: str = "answer") -> None:
    """Generate every job's text and call save(key, text) when it is done (in finishing order)."""
    with progress_bar(total=len(jobs), desc=desc, unit=unit) as bar:
        if batch <= 1:
            for key, ids, params in jobs:
                save(key, llm.generate(ids, params)[0].text)
                bar.update(1)
            return
        engine = llm.batch_engine(max_num_seqs=batch)
        queue = [(key, llm.new_sequence(ids, params)) for key, ids, params in jobs]
        key_of = {seq.request_id: key for key, seq in queue}
        pending = iter(queue)
        for _, seq in itertools.islice(pending, batch):
            engine.add(seq)
        while engine.has_work():
            for seq in engine.step():
                if seq.finished:
                    save(key_of[seq.request_id], seq.to_output().text)
                    bar.update(1)
                    nxt = next(pending, None)
                    if nxt is not None:
                        engine.add(nxt[1])
