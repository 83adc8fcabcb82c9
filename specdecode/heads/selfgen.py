"""Self-distillation data: the target answers requests built from the training corpus, and those
answers (its own words, in its own chat style) become training conversations for a head. A head sees
at inference exactly this kind of text, so a little of it goes a long way next to the corpus.

Two request sets: `self_distill_requests` (code tasks and documentation questions, the corpus's own
kinds) and `diverse_requests` (the kinds of tasks chat users bring: translation, arithmetic word problems,
explanations, advice, letters, stories, summaries, questions on a given passage), built from templates,
word lists and the documentation text that ships with Python. No evaluation set is read.

Answers are appended to a JSONL file as they finish; a rerun skips the requests already answered.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from specdecode.heads.batch_answers import answer_all, cached_rows
from specdecode.heads.corpus import Messages, code_conversations, documentation_texts, prose_conversations


def self_distill_requests(count: int, seed: int = 1) -> list[str]:
    """User requests (code tasks from documented stdlib functions, questions on documentation topics)."""
    rng = random.Random(seed)
    code = [c[0]["content"] for c in code_conversations(rng)]
    prose = [c[0]["content"] for c in prose_conversations(rng) if "Summarize" not in c[0]["content"]]
    requests = code[: (2 * count) // 3 + 1] + prose[: count // 3 + 1]
    rng.shuffle(requests)
    return requests[:count]


LANGUAGES = ("French", "German", "Spanish", "Italian", "Portuguese", "Chinese", "Japanese", "Russian", "Dutch")
THINGS = ("apples", "notebooks", "bicycles", "tickets", "bottles of juice", "pencils", "chairs", "books",
          "loaves of bread", "plants", "shirts", "boxes of tea", "lamps", "cups of coffee", "toy cars")
PEOPLE = ("Maria", "Tom", "Aisha", "Kenji", "Lena", "Carlos", "Priya", "Omar", "Sofia", "Ben")
SUBJECTS = ("photosynthesis", "inflation", "the water cycle", "compound interest", "how vaccines work",
            "plate tectonics", "the French Revolution", "supply and demand", "black holes", "machine learning",
            "the immune system", "climate change", "the printing press", "electric cars", "sleep",
            "public key cryptography", "the Roman Empire", "volcanoes", "renewable energy", "DNA")
ACTIVITIES = ("learning a new language", "running a first marathon", "saving money", "working from home",
              "preparing for a job interview", "cooking for a large group", "studying for exams",
              "starting a vegetable garden", "traveling on a budget", "keeping a daily journal",
              "giving a public talk", "moving to a new city", "training a puppy", "reading more books")
WRITING = ("a short email to a colleague asking to move a meeting to Friday",
           "a thank-you note to a neighbour who watered the plants", "a short poem about autumn rain",
           "a product description for a reusable water bottle", "a short story about a lost robot",
           "a polite complaint to a hotel about a noisy room", "a toast for a friend's wedding",
           "a short dialogue between a customer and a baker", "a cover letter opening for a junior designer",
           "a limerick about a cat who codes", "a review of a fictional science fiction film")
AUDIENCES = ("", " for a beginner", " for a busy parent", " for a student", " on a tight schedule")
TONES = ("", ", in a friendly tone", ", in under 80 words", ", formally")
WORD_PROBLEMS = (
    "{a} buys {n} {thing} at ${p} each and pays with a ${bill} note. How much change does {a} get?",
    "A box holds {n} {thing}. How many boxes are needed for {m} {thing}?",
    "{a} reads {n} pages a day. How many days does a {m}-page book take?",
    "A train travels at {n} km/h for {h} hours and then at {p} km/h for 2 hours. How far does it go?",
    "{a} has ${m} and spends {pct}% of it on {thing}. How much money is left?",
    "The price of {thing} rose from ${p} to ${q}. By what percent did it rise?",
    "{a} and {b} share {m} {thing} in the ratio {n}:{h}. How many does each get?",
)


def _sentences(text: str) -> list[str]:
    """Plain sentences of 8-40 words from documentation text (no code, no markup)."""
    out = []
    for part in re.split(r"(?<=[.!?])\s+", " ".join(text.split())):
        words = part.split()
        if 8 <= len(words) <= 40 and part[-1] in ".!?" and not re.search(r"[`{}\[\]<>=_*#|\\]", part):
            out.append(part)
    return out


def diverse_requests(count: int, seed: int = 2) -> list[str]:
    """`count` chat requests over ten task kinds, in a fixed shuffled order."""
    rng = random.Random(seed)
    docs = documentation_texts()
    sentences = [x for _, text in docs for x in _sentences(text)]
    passages = [(title, text[:1500]) for title, text in docs if len(text) > 600]

    def problem() -> str:
        n, h = rng.randint(2, 12), rng.randint(2, 9)
        p, m = rng.randint(2, 40), rng.randint(50, 600)
        text = rng.choice(WORD_PROBLEMS).format(a=rng.choice(PEOPLE), b=rng.choice(PEOPLE), n=n, h=h, p=p,
                                                q=p + rng.randint(1, 30), m=m, bill=(n * p // 50 + 1) * 50,
                                                pct=rng.choice((10, 15, 20, 25, 40)), thing=rng.choice(THINGS))
        return text + rng.choice(("", " Explain step by step.", " Show your reasoning."))

    kinds = [
        lambda: f"Translate into {rng.choice(LANGUAGES)}:\n{rng.choice(sentences)}",
        lambda: f"Translate this sentence into English and explain one word choice:\n{rng.choice(sentences)}",
        problem,
        problem,
        lambda: rng.choice(("Explain {s} in simple terms.", "What is {s}? Answer in a few sentences.",
                            "Give me a short overview of {s}.", "Why does {s} matter? Explain to a student.",
                            "What are common misconceptions about {s}?")).format(s=rng.choice(SUBJECTS)),
        lambda: f"What are your best tips for {rng.choice(ACTIVITIES)}{rng.choice(AUDIENCES)}?",
        lambda: f"Write {rng.choice(WRITING)}{rng.choice(TONES)}.",
        lambda: "Summarize the following text in two or three sentences.\n\n" + rng.choice(passages)[1],
        lambda: (lambda t: f"Read the passage and answer the question.\n\nPassage: {t[1]}\n\nQuestion: what does "
                           f"the passage say about {t[0]}?")(rng.choice(passages)),
        lambda: f"Rewrite this sentence to be clearer and more formal:\n{rng.choice(sentences)}",
    ]
    unique: dict[str, None] = {}
    for i in range(100 * count):  # the kinds in turn; a repeated request is drawn again
        if len(unique) == count:
            break
        unique[kinds[i % len(kinds)]()] = None
    out = list(unique)
    rng.shuffle(out)
    return out


_TRANSLATE_INTO = re.compile(r"^Translate into (\w+):\n")


def back_translation_requests(conversations: list[Messages]) -> list[str]:
    """Requests to translate the target's own translations (answers to "Translate into LANGUAGE:") back
    into English, in the form "Translate LANGUAGE to English: TEXT": the corpus has no foreign text of its
    own, and translating into English is what chat users most often ask for."""
    out = []
    for conv in conversations:
        m = _TRANSLATE_INTO.match(conv[0]["content"])
        answer = conv[-1]["content"].strip()
        # A translation of one sentence, not an essay about one (or a runaway answer).
        if m and answer and len(answer.split("\n")) <= 3 and len(answer) <= 600:
            out.append(f"Translate {m.group(1)} to English: {answer}")
    return list(dict.fromkeys(out))


def _read_answers(path: Path) -> dict[str, Messages]:
    return {conv[0]["content"]: conv for conv in cached_rows(path)}


def self_distilled_conversations(llm, requests: list[str], out_jsonl: Path, max_tokens: int = 256,  # noqa: ANN001
                                 batch: int = 1, reuse: list[Path] | None = None) -> list[Messages]:
    """The target's greedy answers to `requests` (an LLM), cached in out_jsonl (resumable: answered requests
    are skipped), in request order (a request longer than the context is left out). `batch` > 1 answers
    that many at once with the continuous-batching engine (each row's tokens are those of answering it
    alone on this engine's kernels). Answers to the same requests in the `reuse` files (a smaller set of
    the same kind) are copied instead of answered again."""
    from specdecode.sampling import SamplingParams

    answered = _read_answers(out_jsonl)
    wanted = set(requests)
    known = {r: c for path in reuse or [] for r, c in _read_answers(path).items() if r in wanted and r not in answered}
    todo = [r for r in dict.fromkeys(requests) if r not in answered and r not in known]
    prompt_ids = {r: llm.chat_prompt_ids([{"role": "user", "content": r}]) for r in todo}  # tokenized once

    def params(request: str) -> SamplingParams:  # an answer stops at the context's end, not past it
        room = llm.max_model_len - len(prompt_ids[request])
        return SamplingParams(max_tokens=min(max_tokens, room), temperature=0)

    todo = [r for r in todo if params(r).max_tokens >= 1]  # a request longer than the context is left out
    out_jsonl.parent.mkdir(parents=True, exist_ok=True)
    if known:
        with out_jsonl.open("a") as f:
            f.writelines(json.dumps(conv) + "\n" for conv in known.values())
        answered.update(known)
    with out_jsonl.open("a") as f:
        def save(request: str, answer: str) -> None:
            conv = [{"role": "user", "content": request}, {"role": "assistant", "content": answer}]
            f.write(json.dumps(conv) + "\n")
            f.flush()
            answered[request] = conv

        answer_all(llm, [(r, prompt_ids[r], params(r)) for r in todo], save, batch=batch)  # type: ignore[arg-type]
    return [answered[r] for r in requests if r in answered]
