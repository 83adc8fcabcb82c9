"""Requests the target writes itself: a head learns from the target's answers, so the more kinds of chat
request it has answered, the more of what users bring it covers. Templates alone repeat themselves after
a few hundred requests; asking the target (sampled, one seed per request) to write a request of a given
kind on a given topic gives thousands of different ones: creative writing, role-play, reasoning, math,
science, history, search-engine questions, advice, extraction, comparisons and texts to translate into
English. No evaluation set is read; the kinds and topics below are our own.

The written requests are cached in a JSONL file (one line per seed) and a rerun skips the seeds done.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from specdecode.heads.batch_answers import answer_all, cached_rows

REQUEST_KINDS = (
    "Write one request that a user might send to an AI assistant for a piece of creative writing (a story, a poem, "
    "a letter, a speech or a blog post) about {topic}. Reply with the request only.",
    "Write one request that a user might send to an AI assistant asking it to play a character or a professional "
    "and answer in character, on the subject of {topic}. Reply with the request only.",
    "Write one tricky reasoning or logic question that involves {topic}. Reply with the question only.",
    "Write one math word problem about {topic} that takes a few steps to solve. Reply with the problem only.",
    "Write one question a student might ask about the science or technology behind {topic}. Reply with the "
    "question only.",
    "Write one question about the history, culture or economics of {topic}. Reply with the question only.",
    "Write one short factual question about {topic}, the kind a person types into a search engine. Reply with "
    "the question only.",
    "Write one message asking an AI assistant for practical advice about {topic}. Reply with the message only.",
    "Write a short paragraph of facts about {topic}, followed by a request to extract specific details from it "
    "in a given format. Reply with the paragraph and the request only.",
    "Write one request asking an AI assistant to compare two things related to {topic}. Reply with the "
    "request only.",
    "TRANSLATE",  # two or three sentences in a language, which become "Translate <lang> to English: ..."
    "TRANSLATE",
)
TRANSLATE_PROMPT = "Write two or three sentences in {lang} about {topic}. Reply with the {lang} text only."
SOURCE_LANGUAGES = ("German", "French", "Spanish", "Italian", "Portuguese", "Dutch", "Chinese", "Russian", "Japanese")

TOPICS = (
    "the ocean", "medieval castles", "volcanoes", "a small bakery", "coffee", "honeybees", "the moon landing",
    "electric cars", "a city library", "football", "chess", "jazz music", "ancient Egypt", "the human heart",
    "rainforests", "smartphones", "trains", "a summer holiday", "vaccines", "the stock market", "cooking pasta",
    "dinosaurs", "the Olympic Games", "solar panels", "a job interview", "learning the piano", "birds migration",
    "the internet", "a wedding", "recycling", "mountain climbing", "the Renaissance", "earthquakes", "cats",
    "dogs", "a startup company", "space telescopes", "the weather", "a hospital", "gardening", "photography",
    "world war II", "the printing press", "bread", "airplanes", "a marathon", "climate change", "Shakespeare",
    "a museum", "the Amazon river", "time management", "friendship", "a school exam", "wine making", "bicycles",
    "the Roman Empire", "artificial intelligence", "a family dinner", "sleep", "taxes", "a rental apartment",
    "a zoo", "the solar system", "video games", "a farmers market", "tea", "the Great Wall of China", "robots",
    "a birthday party", "public transport", "the immune system", "movies", "a road trip", "mathematics",
    "an old lighthouse", "social media", "a hotel stay", "the Arctic", "nutrition", "a bookshop", "insurance",
    "the French Revolution", "oceans plastic", "a science fair", "fitness", "architecture", "a pet shop",
    "electricity", "a musical instrument", "the desert", "a restaurant menu", "online shopping", "a volunteer group",
    "genetics", "a detective", "pirates", "a village festival", "the Industrial Revolution", "a mobile app",
    "money and banking", "the brain", "a winter storm", "a toy factory", "philosophy", "a football club",
    "ancient Greece", "a newspaper", "a dentist visit", "electric guitars", "wolves", "the Silk Road", "a farm",
    "a train station", "nuclear energy", "poetry", "a supermarket", "the human eye", "a flight delay",
    "knitting", "an election", "a university course", "a car repair", "water supply", "the Vikings",
    "a coffee shop", "mushrooms", "a chess tournament", "fashion", "a hiking trail", "a hospital nurse",
    "the periodic table", "a bank loan", "a carpenter", "a language exchange", "the Nile", "a small island",
)


def written_request_prompts(count: int, seed: int = 3) -> list[str]:
    """The `count` prompts that ask the target for a request, kinds in turn, topics and languages drawn."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        kind, topic = REQUEST_KINDS[i % len(REQUEST_KINDS)], rng.choice(TOPICS)
        lang = rng.choice(SOURCE_LANGUAGES)
        out.append(TRANSLATE_PROMPT.format(lang=lang, topic=topic) if kind == "TRANSLATE" else kind.format(topic=topic))
    return out


_OPENING = re.compile(r"^(sure|certainly|of course|here('s| is| are)|okay|ok)\b", re.IGNORECASE)
_LABEL = re.compile(r"^\**(request|question|problem|message|user|prompt|task)\**\s*:\s*\**\s*", re.IGNORECASE)
_TRANSLATE_PROMPT = re.compile(r"^Write two or three sentences in (\w+) about ")


def clean_written_request(prompt: str, reply: str) -> str | None:
    """The user request in the target's reply to a `written_request_prompts` prompt, or None when the reply
    holds none (too short, too long, or a question back instead of a request). Texts in another language
    become requests to translate them into English."""
    lines = [line.strip() for line in reply.strip().splitlines()]
    while len(lines) > 1 and (not lines[0] or _OPENING.match(lines[0])):  # "Sure, here is one:"
        lines.pop(0)
    text = _LABEL.sub("", "\n".join(lines).strip()).strip()
    if len(text) > 1 and text[0] == text[-1] and text[0] in "\"'“”":
        text = text[1:-1].strip()
    text = text.replace("“", "").replace("”", "") if text.startswith("“") else text
    if not 12 <= len(text) <= 1500 or _OPENING.match(text):  # no request, only a reply to the asker
        return None
    if m := _TRANSLATE_PROMPT.match(prompt):
        if len(text.split("\n")) > 6:
            return None
        return f"Translate {m.group(1)} to English: {text}"
    return text


def _read_replies(path: Path) -> dict[int, dict]:
    """seed -> row of a written-requests file."""
    return {row["seed"]: row for row in cached_rows(path)}


def written_requests(llm, count: int, out_jsonl: Path, batch: int = 8, seed: int = 3,  # noqa: ANN001
                     max_tokens: int = 192, reuse: list[Path] | None = None) -> list[str]:
    """`count` requests written by the target (sampled at temperature 0.9, top-p 0.95, seed i for the i-th
    prompt), cleaned and without repeats; cached in out_jsonl (resumable). The i-th prompt is the same for any
    count, so the replies of another set in `reuse` (e.g. written-requests-2400.jsonl for 3600) are copied
    where seed and prompt match: a larger set only writes its new requests."""
    from specdecode.sampling import SamplingParams

    prompts = written_request_prompts(count, seed)
    done = {i: row["reply"] for i, row in _read_replies(out_jsonl).items()}
    known = {i: row for path in reuse or [] for i, row in _read_replies(path).items()
             if i < count and i not in done and row.get("prompt") == prompts[i]}
    done.update({i: row["reply"] for i, row in known.items()})
    todo = [i for i in range(count) if i not in done]
    out_jsonl.parent.mkdir(parents=True, exist_ok=True)
    with out_jsonl.open("a") as f:
        f.writelines(json.dumps(row) + "\n" for _, row in sorted(known.items()))
        def save(i: int, reply: str) -> None:
            f.write(json.dumps({"seed": i, "prompt": prompts[i], "reply": reply}) + "\n")
            f.flush()
            done[i] = reply

        jobs = [(i, llm.chat_prompt_ids([{"role": "user", "content": prompts[i]}]),
                 SamplingParams(max_tokens=max_tokens, temperature=0.9, top_p=0.95, seed=i)) for i in todo]
        answer_all(llm, jobs, save, batch=batch, desc="written requests", unit="request")
    cleaned = (clean_written_request(prompts[i], done[i]) for i in range(count))
    return list(dict.fromkeys(r for r in cleaned if r))
