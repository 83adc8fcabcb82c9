"""Self-distillation data: the target answers requests built from the training corpus, and those
answers (its own words, in its own chat style) become training conversations for a head. A head sees
at inference exactly this kind of text, so a little of it goes a long way next to the corpus.

Answers are appended to a JSONL file one per line as they finish; a rerun continues after the last.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from specdecode.heads.corpus import Messages, code_conversations, prose_conversations
from specdecode.heads.features import progress_bar


def self_distill_requests(count: int, seed: int = 1) -> list[str]:
    """User requests (code tasks from documented stdlib functions, questions on documentation topics)."""
    rng = random.Random(seed)
    code = [c[0]["content"] for c in code_conversations(rng)]
    prose = [c[0]["content"] for c in prose_conversations(rng) if "Summarize" not in c[0]["content"]]
    requests = code[: (2 * count) // 3 + 1] + prose[: count // 3 + 1]
    rng.shuffle(requests)
    return requests[:count]


def self_distilled_conversations(llm, requests: list[str], out_jsonl: Path, max_tokens: int = 256) -> list[Messages]:  # noqa: ANN001 - an LLM
    """The target's greedy answers to `requests`, cached in out_jsonl (resumable)."""
    from specdecode.sampling import SamplingParams

    done: list[Messages] = []
    if out_jsonl.exists():
        done = [json.loads(line) for line in out_jsonl.read_text().splitlines() if line.strip()]
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    out_jsonl.parent.mkdir(parents=True, exist_ok=True)
    with out_jsonl.open("a") as f:
        for request in progress_bar(requests[len(done) :], desc="target answers", unit="answer"):
            messages = [{"role": "user", "content": request}]
            answer = llm.chat([messages], params)[0].text
            conv = [*messages, {"role": "assistant", "content": answer}]
            f.write(json.dumps(conv) + "\n")
            f.flush()
            done.append(conv)
    return done[: len(requests)]
