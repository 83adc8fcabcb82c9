"""Training conversations for draft heads, built from text that ships with Python itself.

The evaluation sets in shared/data (HumanEval, Spec-Bench, GSM8K, MT-bench) are never read here:
code comes from the standard library's own functions (signature + docstring as the request, the
implementation as the answer) and prose from its documentation topics and installed packages'
descriptions. The head learns to predict the *target's* next token on these texts, so the answers
need not be the target's own words.
"""

from __future__ import annotations

import ast
import random
import sysconfig
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

Messages = list[dict[str, str]]

CODE_REQUESTS = (
    "Complete the following Python function:\n```python\n{head}\n```",
    "Implement this Python function.\n\n```python\n{head}\n```",
    "Write the body of the function below.\n```python\n{head}\n```",
    "{doc}\nWrite a Python function `{name}` that does this.",
)
PROSE_REQUESTS = (
    "Explain the following topic: {title}",
    "Summarize the following text.\n\n{text}",
    "What does the Python documentation say about {title}?",
    "Answer briefly: what is {title}?",
)
MAX_CODE_CHARS = 2400
MAX_PROSE_CHARS = 2400


def _functions(path: Path) -> Iterator[tuple[str, str, str, str]]:
    """(name, head = signature + docstring, full source, docstring) of documented top-level functions."""
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return
    lines = source.splitlines()
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        doc = ast.get_docstring(node)
        if not doc or node.end_lineno is None or len(node.body) < 2:
            continue
        first = node.body[0]
        body_start = node.body[1].lineno - 1
        full = "\n".join(lines[node.lineno - 1 : node.end_lineno])
        if len(full) > MAX_CODE_CHARS or first.end_lineno is None:
            continue
        head = "\n".join(lines[node.lineno - 1 : min(first.end_lineno, body_start)])
        yield node.name, head, full, doc


def code_conversations(rng: random.Random) -> list[Messages]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.rglob("*.py") if "test" not in p.parts and "site-packages" not in p.parts)
    out = []
    for path in files:
        for name, head, full, doc in _functions(path):
            request = rng.choice(CODE_REQUESTS).format(head=head, name=name, doc=doc.split("\n\n")[0])
            answer = f"Here is the implementation:\n\n```python\n{full}\n```"
            out.append([{"role": "user", "content": request}, {"role": "assistant", "content": answer}])
    return out


def _topics() -> Iterator[tuple[str, str]]:
    from pydoc_data.topics import topics  # the text behind help('keyword') in the interpreter

    for title, text in sorted(topics.items()):
        yield title.replace("-", " "), text


def _package_descriptions() -> Iterator[tuple[str, str]]:
    for dist in sorted(metadata.distributions(), key=lambda d: d.metadata["Name"] or ""):
        body = dist.metadata.get_payload() if hasattr(dist.metadata, "get_payload") else ""
        text = str(body or dist.metadata.get("Description") or "")
        if len(text) > 400:
            yield str(dist.metadata["Name"]), text


def documentation_texts() -> list[tuple[str, str]]:
    """(title, text) of the interpreter's documentation topics and the installed packages' descriptions."""
    return [*_topics(), *_package_descriptions()]


def prose_conversations(rng: random.Random) -> list[Messages]:
    out = []
    for title, text in documentation_texts():
        for start in range(0, min(len(text), 4 * MAX_PROSE_CHARS), MAX_PROSE_CHARS):
            part = text[start : start + MAX_PROSE_CHARS].strip()
            if len(part) < 200:
                continue
            template = rng.choice(PROSE_REQUESTS)
            if "{text}" in template:
                # A summary request answered by the passage's opening: the target reads both.
                request, answer = template.format(text=part), part[: len(part) // 3]
            else:
                request, answer = template.format(title=title), part
            out.append([{"role": "user", "content": request}, {"role": "assistant", "content": answer}])
    return out


def training_conversations(seed: int = 0) -> list[Messages]:
    """Code and prose conversations, shuffled with a fixed seed (the order is part of resumability)."""
    rng = random.Random(seed)
    convs = code_conversations(rng) + prose_conversations(rng)
    rng.shuffle(convs)
    return convs
