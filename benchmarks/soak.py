"""Soak test: one server under mixed, partly faulty traffic for a while, then a check that it leaked nothing.

Starts `specdecode serve` (by default SmolLM2-135M with n-gram speculation, a small batch and queue so that
the queue fills) on 127.0.0.1 at a free port, then runs --clients closed-loop clients for --duration seconds.
Each request is drawn at random: chat or completion, streamed or not, random prompt and max_tokens lengths,
and with these shares: 5% streams the client drops after its first events, 5% malformed requests (bad JSON,
wrong types, unknown fields, an oversized body, ...), 5% structured outputs (a JSON schema; a finished
answer must parse), 5% with a short `timeout` field (a 408, or an error event in a stream). Every loop is
bounded: the clients stop at the deadline and each request has a client timeout above the server's
--request-timeout.

At the end it waits for the engine to go idle and reads the server's /metrics: rows still running or waiting
then are leaked rows. It records the server's RSS (psutil, on the server's pid) after a warm-up, during the
run and at the end, checks /health, stops the server with SIGTERM (a drained exit is code 0), and writes
soak.json and soak.md to --out: requests per kind, responses by status or error kind, 5xx responses and
client-side failures. The run passes with no 5xx, no failure, no leaked row and a clean exit.

Example (the full soak)::

    python benchmarks/soak.py --out bench-out/soak

Short check::

    python benchmarks/soak.py --duration 30 --clients 4 --out bench-out/soak-short
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specdecode.bench.process import free_port, wait_healthy  # noqa: E402
from specdecode.cli_args import add_model_args  # noqa: E402

HOST = "127.0.0.1"
WORDS = ("the quick brown fox jumps over a lazy dog while seven silver birds sing about rivers mountains code "
         "numbers stars bread music light and time").split()
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
SHARES = (("disconnect", 0.05), ("malformed", 0.05), ("structured", 0.05), ("timeout", 0.05))
"""Kinds of request and their shares; the rest are plain chat or completion requests."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.set_defaults(model="smollm2-135m-instruct", method="ngram")
    p.add_argument("--clients", type=int, default=16, help="closed-loop clients (default: %(default)s)")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of traffic (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64, help="largest max_tokens drawn (default: %(default)s)")
    p.add_argument("--max-prompt-words", type=int, default=300, help="longest prompt drawn (default: %(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=4, help="server batch rows (default: %(default)s)")
    p.add_argument("--max-waiting", type=int, default=8, help="server queue (default: %(default)s)")
    p.add_argument("--request-timeout", type=float, default=60.0, help="the server's (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None, help="the server's torch threads (default: its own)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--out", type=Path, default=None, help="write soak.json and soak.md here")
    args = p.parse_args(argv)
    if args.clients < 1 or args.duration <= 0 or args.max_tokens < 1 or args.max_prompt_words < 1:
        p.error("--clients, --duration, --max-tokens and --max-prompt-words must be positive")
    return args


# ---- server ----------------------------------------------------------------------------------------------------


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    cmd = [sys.executable, "-m", "specdecode.cli", "serve", "--model", args.model, "--dtype", args.dtype,
           "--quantization", args.quantization, "--host", HOST, "--port", str(port),
           "--max-num-seqs", str(args.max_num_seqs), "--max-waiting", str(args.max_waiting),
           "--request-timeout", str(args.request_timeout), "--log-level", "warning"]
    for flag, value in (("--device", args.device), ("--max-model-len", args.max_model_len),
                        ("--speculative-config", args.speculative_config), ("--draft", args.draft),
                        ("--method", args.method), ("--head", args.head), ("--threads", args.threads),
                        ("--num-speculative-tokens", args.num_speculative_tokens)):
        if value is not None:
            cmd += [flag, str(value)]
    print("starting:", " ".join(cmd), file=sys.stderr)
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"specdecode-soak-{port}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
    url = f"http://{HOST}:{port}"
    try:
        wait_healthy(proc, url, args.startup_timeout)
    except (TimeoutError, RuntimeError):
        proc.kill()
        raise RuntimeError(f"the server did not start; its log: {log}") from None
    return proc, url, log


def rss_mb(pid: int) -> float | None:
    try:
        return psutil.Process(pid).memory_info().rss / 2**20
    except psutil.Error:
        return None


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def wait_idle(url: str, timeout: float) -> dict[str, float]:
    """/metrics once no row runs or waits, or after `timeout` seconds (then what is left is leaked)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        idle = m.get("specdecode_requests_running", 0) == 0 and m.get("specdecode_requests_waiting", 0) == 0
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.5)


# ---- requests --------------------------------------------------------------------------------------------------


def prompt(rng: random.Random, args: argparse.Namespace) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, args.max_prompt_words)))


def plain_body(rng: random.Random, args: argparse.Namespace, model: str) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"model": model, "max_tokens": rng.randint(1, args.max_tokens),
                            "temperature": rng.choice([0.0, 0.7]), "stream": rng.random() < 0.5}
    if rng.random() < 0.5:
        return "/v1/completions", {**body, "prompt": prompt(rng, args)}
    return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt(rng, args)}]}


def malformed(rng: random.Random, model: str) -> tuple[str, bytes]:
    """A request the server must refuse with a 4xx."""
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    bad: list[Any] = [
        b'{"model": "x", "messages": [', b"not json at all", b"[]", b'{"prompt": NaN}',
        {**chat, "max_tokens": "ten"}, {**chat, "temperature": -1}, {**chat, "messages": []},
        {**chat, "no_such_field": 1}, {**chat, "model": "no-such-model"}, {**chat, "n": 10_000},
        {**chat, "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": "{"}}},
        {**chat, "messages": [{"role": "user", "content": "\ud800"}]},
        {**chat, "messages": [{"role": "user", "content": "x" * (1 << 20)}]},  # over the body limit: a 413
    ]
    item = rng.choice(bad)
    path = "/v1/chat/completions" if rng.random() < 0.8 else "/v1/completions"
    if isinstance(item, bytes):
        return path, item
    return path, json.dumps(item).encode("utf-8", "surrogatepass")


def read_stream(r: httpx.Response, drop_after: int | None) -> tuple[str, str, str | None]:
    """(outcome, text, finish_reason) of a streamed response; after `drop_after` events the client goes away."""
    events, text, finish = 0, [], None
    for line in r.iter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            return "200", "".join(text), finish
        event = json.loads(line[6:])
        if "error" in event:
            return f"stream_error:{event['error'].get('code')}", "", None
        for choice in event.get("choices", []):
            text.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
            finish = choice.get("finish_reason") or finish
        events += 1
        if drop_after is not None and events >= drop_after:
            return "disconnect", "", None
    return "stream_truncated", "", None


def json_reply(body: dict[str, Any]) -> str:
    choice = body["choices"][0]
    return choice.get("text") if "text" in choice else choice["message"]["content"] or ""


def check_structured(outcome: str, text: str, finished: bool) -> str:
    if outcome != "200" or not finished:
        return outcome
    try:
        value = json.loads(text)
        return "200" if isinstance(value, dict) and set(SCHEMA["required"]) <= set(value) else "structured_invalid"
    except ValueError:
        return "structured_invalid"


def one_request(client: httpx.Client, rng: random.Random, args: argparse.Namespace, model: str) -> tuple[str, str]:
    """(kind, outcome) of one random request."""
    draw, kind = rng.random(), "plain"
    for name, share in SHARES:
        if draw < share:
            kind = name
            break
        draw -= share
    if kind == "malformed":
        path, raw = malformed(rng, model)
        r = client.post(path, content=raw, headers={"content-type": "application/json"})
        return kind, str(r.status_code)
    path, body = plain_body(rng, args, model)
    drop_after = None
    if kind == "disconnect":
        body.update(stream=True, max_tokens=args.max_tokens, ignore_eos=True)
        drop_after = rng.randint(1, 4)
    elif kind == "structured":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
        body["max_tokens"] = max(body["max_tokens"], 48)
    elif kind == "timeout":
        body.update(timeout=rng.uniform(0.01, 0.5), max_tokens=args.max_tokens, ignore_eos=True)
    if not body["stream"] and kind != "disconnect":
        r = client.post(path, json=body)
        if r.status_code != 200:
            return kind, str(r.status_code)
        reply = r.json()
        finished = reply["choices"][0]["finish_reason"] == "stop"
        return kind, check_structured("200", json_reply(reply), finished) if kind == "structured" else "200"
    with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            r.read()
            return kind, str(r.status_code)
        outcome, text, finish = read_stream(r, drop_after)
    return kind, check_structured(outcome, text, finish == "stop") if kind == "structured" else outcome


def client_loop(i: int, url: str, args: argparse.Namespace, model: str, end: float, tally: Counter) -> None:
    rng = random.Random(args.seed * 1000 + i)
    timeout = httpx.Timeout(args.request_timeout + 30, connect=10)
    with httpx.Client(base_url=url, timeout=timeout) as client:
        while time.monotonic() < end:
            try:
                kind, outcome = one_request(client, rng, args, model)
            except httpx.HTTPError as exc:
                kind, outcome = "any", f"client_error:{type(exc).__name__}"
            except (ValueError, KeyError, IndexError, TypeError) as exc:  # not the JSON it should be
                kind, outcome = "any", f"bad_response:{type(exc).__name__}"
            tally[(kind, outcome)] += 1
            if outcome in ("429", "503"):  # back off as OpenAI's client does, instead of hammering the queue
                time.sleep(min(rng.uniform(0.5, 1.5), max(0.0, end - time.monotonic())))


# ---- the run ---------------------------------------------------------------------------------------------------


FAILURES = ("client_error", "bad_response", "stream_truncated", "structured_invalid")


def is_failure(outcome: str) -> bool:
    if outcome.startswith(FAILURES) or (outcome.isdigit() and int(outcome) >= 500):
        return True
    return outcome.startswith("stream_error:") and outcome != "stream_error:request_timeout"


def soak(args: argparse.Namespace) -> dict[str, Any]:
    proc, url, log = start_server(args)
    tally: Counter = Counter()
    try:
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        httpx.post(url + "/v1/chat/completions", timeout=300, json={  # warm-up, before the first RSS figure
            "model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}).raise_for_status()
        rss = [rss_mb(proc.pid)]
        t0 = time.monotonic()
        end = t0 + args.duration
        threads = [threading.Thread(target=client_loop, args=(i, url, args, model, end, tally), daemon=True)
                   for i in range(args.clients)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            for t in threads:
                t.join(timeout=max(0.1, min(10.0, end - time.monotonic())))
            rss.append(rss_mb(proc.pid))
            if time.monotonic() > end + args.request_timeout + 60:
                raise RuntimeError("clients still running long past the deadline")
        seconds = time.monotonic() - t0
        m = wait_idle(url, timeout=60)
        rss_end = rss_mb(proc.pid)
        healthy = httpx.get(url + "/health", timeout=10).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait(10)
    by_outcome: Counter = Counter()
    by_kind: dict[str, Counter] = {}
    for (kind, outcome), count in tally.items():
        by_outcome[outcome] += count
        by_kind.setdefault(kind, Counter())[outcome] += count
    running, waiting = m.get("specdecode_requests_running", 0), m.get("specdecode_requests_waiting", 0)
    samples = [r for r in rss if r is not None]
    summary = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "seconds": round(seconds, 1),
        "requests": sum(tally.values()),
        "by_kind": {k: dict(c) for k, c in sorted(by_kind.items())},
        "by_outcome": dict(by_outcome.most_common()),
        "responses_5xx": sum(c for o, c in by_outcome.items() if o.isdigit() and int(o) >= 500),
        "failures": sum(c for o, c in by_outcome.items() if is_failure(o)),
        "leaked_rows": int(running), "waiting_after": int(waiting),
        "kv_cache_usage_after": m.get("specdecode_kv_cache_usage"),
        "server_errors_by_code": {k.split('"')[1]: v for k, v in m.items()
                                  if k.startswith("specdecode_request_errors_total{")},
        "rss_mb": {"start": samples[0] if samples else None, "max": max(samples) if samples else None,
                   "end": rss_end},
        "healthy_after": healthy, "exit_code": code, "server_log": str(log),
    }
    summary["passed"] = (summary["responses_5xx"] == 0 and summary["failures"] == 0 and running == 0
                         and waiting == 0 and healthy and code == 0)
    return summary


def markdown(s: dict[str, Any]) -> str:
    a = s["args"]
    rss = s["rss_mb"]
    lines = [f"Soak: {a['model']} ({a['method'] or 'no speculation'}), {a['clients']} clients for {s['seconds']} s, "
             f"--max-num-seqs {a['max_num_seqs']}, --max-waiting {a['max_waiting']}, "
             f"--request-timeout {a['request_timeout']}: **{'passed' if s['passed'] else 'FAILED'}**", "",
             f"{s['requests']} requests; 5xx: {s['responses_5xx']}; failures: {s['failures']}; leaked rows: "
             f"{s['leaked_rows']} (waiting after: {s['waiting_after']}); /health after: "
             f"{'200' if s['healthy_after'] else 'not 200'}; exit code {s['exit_code']}",
             f"RSS (MB): {_mb(rss['start'])} after warm-up, {_mb(rss['max'])} at most, {_mb(rss['end'])} at the end",
             "", "| kind | outcome | count |", "|---|---|---:|"]
    for kind, outcomes in s["by_kind"].items():
        for outcome, count in sorted(outcomes.items(), key=lambda x: -x[1]):
            lines.append(f"| {kind} | {outcome} | {count} |")
    return "\n".join(lines)


def _mb(value: float | None) -> str:
    return "?" if value is None else f"{value:.0f}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    summary = soak(args)
    table = markdown(summary)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "soak.json").write_text(json.dumps(summary, indent=2) + "\n")
        (args.out / "soak.md").write_text(table + "\n")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
