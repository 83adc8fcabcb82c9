"""Write the suffix-decoding workloads of `specdecode bench` to benchmarks/data/suffix/ (deterministic).

- code_edits.jsonl: a function from CPython's standard library (PSF License 2.0, read from this interpreter's own
  stdlib) and an instruction to change part of it (rename a variable, add type hints, add a docstring, turn a
  loop's print into logging); the answer rewrites the function, so most of it is copied.
- extraction.jsonl: a short free-text order note (generated) to turn into one JSON object of fixed keys; every
  answer has the same layout.
- agent.jsonl: a coding agent's conversation (generated): the tools in a system message, a task, earlier tool
  calls as JSON and their observations; the answer is the next tool call.

    python benchmarks/suffix_workloads.py [--per-task 12] [--seed 0] [--out DIR]

The benchmark's sets are seed 0; a set to try settings on is another seed, written elsewhere.
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import sysconfig
import textwrap
from pathlib import Path

OUT = Path(__file__).resolve().parent / "data" / "suffix"
STDLIB_MODULES = ("textwrap", "shlex", "fnmatch", "calendar", "colorsys", "heapq", "bisect", "difflib", "glob",
                  "ipaddress", "mimetypes", "netrc", "pprint", "quopri", "sched", "statistics", "tabnanny",
                  "tokenize", "uu", "zipapp", "csv", "configparser", "gettext", "smtplib", "ftplib", "wave")


def _functions(seed: int) -> list[tuple[str, str, ast.FunctionDef]]:
    """(module, source, node) of stdlib functions of 12 to 40 lines with a local variable to rename."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for name in STDLIB_MODULES:
        path = root / f"{name}.py"
        if not path.is_file():
            continue
        text = path.read_text(encoding="utf-8")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef) and 12 <= node.end_lineno - node.lineno + 1 <= 40:
                segment = ast.get_source_segment(text, node)
                if segment and "\t" not in segment and _locals(node):
                    found.append((name, textwrap.dedent(" " * node.col_offset + segment), node))
    random.Random(seed).shuffle(found)
    return found


def _locals(node: ast.FunctionDef) -> list[str]:
    names = {t.id for n in ast.walk(node) if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    return sorted(n for n in names if len(n) >= 3)


def code_edits(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i, (module, source, node) in enumerate(_functions(seed)[:n]):
        kind = i % 3
        if kind == 0:
            old = rng.choice(_locals(node))
            change = f"Rename the local variable `{old}` to `{old}_value` everywhere in it."
        elif kind == 1:
            change = "Add type hints to its parameters and return value."
        else:
            change = "Add a docstring that says what it does, in one or two sentences."
        prompt = (f"Here is a function from Python's `{module}` module:\n\n```python\n{source}\n```\n\n{change} "
                  "Do not change anything else. Answer with the complete updated function in one Python code "
                  "block and nothing else.")
        rows.append({"id": f"edit-{i}", "category": "code_edits", "prompt": prompt})
    return rows


NAMES = ["Ana Ruiz", "Tom Becker", "Mei Chen", "Omar Haddad", "Lena Novak", "Ravi Patel", "Sara Lind", "Jon Berg",
         "Ines Costa", "Yuki Sato", "Paul Weber", "Nora Kim", "Eva Horvat", "Liam Walsh", "Aisha Bello"]
PRODUCTS = [("USB-C cable", 9.5), ("desk lamp", 34.0), ("mechanical keyboard", 89.0), ("webcam", 59.9),
            ("laptop stand", 42.5), ("noise-cancelling headphones", 199.0), ("monitor arm", 75.0),
            ("wireless mouse", 25.0), ("external SSD", 119.0), ("phone charger", 19.9)]
CITIES = ["Lisbon", "Berlin", "Osaka", "Toronto", "Nairobi", "Madrid", "Oslo", "Dublin", "Krakow", "Austin"]
STATUSES = ["shipped", "delayed", "delivered", "refund requested", "awaiting payment"]


def extraction(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed + 1)
    rows = []
    for i in range(n):
        name, (product, price), city = rng.choice(NAMES), rng.choice(PRODUCTS), rng.choice(CITIES)
        qty, status, order = rng.randint(1, 5), rng.choice(STATUSES), rng.randint(10000, 99999)
        note = rng.choice([
            f"Hi, this is {name} from {city}. I ordered {qty} x {product} (order #{order}) and the tracking page "
            f"says {status}. Can you confirm the total of {qty * price:.2f} EUR?",
            f"Order {order}: {qty} units of {product} for {name}, shipping to {city}. Current status: {status}. "
            f"Invoice amount {qty * price:.2f} EUR.",
            f"Customer {name} ({city}) wrote about order no. {order}; it was {qty} {product}(s) at {price:.2f} EUR "
            f"each, and the order is now marked {status}.",
        ])
        prompt = ("Extract the order from this message as one JSON object with exactly these keys: "
                  '"customer", "city", "order_id" (integer), "product", "quantity" (integer), "unit_price" '
                  '(number), "total" (number), "status". Answer with the JSON object only.\n\n' + note)
        rows.append({"id": f"extract-{i}", "category": "repeated_format", "prompt": prompt})
    return rows


TOOLS = ("You are a coding agent. Call one tool per turn, as a JSON object on one line: "
         '{"tool": NAME, "arguments": {...}}. Tools: search_code(query: str, path: str), '
         "read_file(path: str, start_line: int, end_line: int), run_tests(path: str, keyword: str), "
         "edit_file(path: str, old: str, new: str), finish(summary: str).")
FILES = ["src/cache.py", "src/http/client.py", "src/parser.py", "src/models/user.py", "src/utils/dates.py",
         "src/queue.py", "src/auth/tokens.py", "src/report.py"]
SYMBOLS = ["get_or_create", "parse_header", "retry_after", "normalize_email", "to_utc", "pop_batch", "refresh_token",
           "render_table", "load_config", "evict_expired"]
BUGS = ["raises KeyError on an empty input", "returns stale values after an update", "ignores the timezone",
        "drops the last item", "fails on non-ASCII names", "retries forever on a 429"]


def _call(tool: str, **arguments: object) -> str:
    return json.dumps({"tool": tool, "arguments": arguments})


def agent(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed + 2)
    rows = []
    for i in range(n):
        path, symbol, bug = rng.choice(FILES), rng.choice(SYMBOLS), rng.choice(BUGS)
        line = rng.randint(20, 180)
        test = "tests/test_" + path.rsplit("/", 1)[-1]
        steps = [
            (_call("search_code", query=f"def {symbol}", path="src"),
             f"{path}:{line}: def {symbol}(self, key, default=None):"),
            (_call("read_file", path=path, start_line=line, end_line=line + 12),
             f"{line}     def {symbol}(self, key, default=None):\n{line + 1}         value = self._data[key]\n"
             f"{line + 2}         return value if value is not None else default"),
            (_call("run_tests", path=test, keyword=symbol),
             f"FAILED {test}::test_{symbol}_empty - KeyError: 'missing'\n1 failed, 11 passed in 0.42s"),
            (_call("edit_file", path=path, old="        value = self._data[key]",
                   new="        value = self._data.get(key)"),
             f"Edited {path}: 1 replacement."),
        ]
        turns = rng.randint(1, len(steps) - 1)
        messages = [{"role": "system", "content": TOOLS},
                    {"role": "user", "content": f"Task: `{symbol}` in {path} {bug}. Find the cause and fix it."}]
        for call, observation in steps[:turns]:
            messages.append({"role": "assistant", "content": call})
            messages.append({"role": "user", "content": "Observation:\n" + observation})
        rows.append({"id": f"agent-{i}", "category": "agent", "messages": messages})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--per-task", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=OUT, help="folder to write (default: %(default)s)")
    args = p.parse_args()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    for name, make in (("code_edits", code_edits), ("extraction", extraction), ("agent", agent)):
        rows = make(args.per_task, args.seed)
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        print(f"{out / name}.jsonl: {len(rows)} prompts")


if __name__ == "__main__":
    main()
