"""`specdecode chat`: the conversation it keeps (in-process) and the terminal session (through a pseudo-terminal)."""

from __future__ import annotations

import io
import os
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from specdecode import LLM, SamplingParams
from specdecode.chat_cli import ChatSession

STATS = re.compile(r"\[(\d+) tokens, [\d.]+ tok/s, tau ([\d.]+), context (\d+)/(\d+)\]")


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def test_session_keeps_the_conversation_and_resets(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="fp32", device="cpu", speculative_config={"method": "ngram"})
    session = ChatSession(llm, SamplingParams(max_tokens=1, temperature=0.0), 6, "Be brief.")
    out = io.StringIO()
    rc = session.run(io.StringIO("hello\nhow are you\n/reset\nhello\n"), out)  # ends with end of input
    assert rc == 0
    stats = [tuple(map(float, m.groups())) for m in STATS.finditer(out.getvalue())]
    assert len(stats) == 3 and all(s[0] <= 6 and s[1] >= 1.0 for s in stats), out.getvalue()
    first, second, after_reset = (int(s[2]) for s in stats)
    assert second > first  # the second turn's prompt holds the first exchange
    assert after_reset == first  # greedy: the same first turn again
    assert "(conversation cleared)" in out.getvalue()
    assert [m["role"] for m in session.history] == ["user", "assistant"]
    # The system prompt opens the templated conversation.
    assert llm.tokenizer.hf.decode(llm.chat_prompt_ids(session.system + session.history)).startswith(
        "<|im_start|>system\nBe brief.")


def test_session_drops_the_oldest_exchanges_to_fit(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="fp32", device="cpu", max_model_len=64)
    session = ChatSession(llm, SamplingParams(max_tokens=1), 4, None)
    out = io.StringIO()
    session.run(io.StringIO("".join(f"message number {i} about the quick brown fox\n" for i in range(6))), out)
    text = out.getvalue()
    assert "oldest messages are dropped" in text
    assert len(STATS.findall(text)) == 6
    session.run(io.StringIO("fox " * 80 + "\n"), out)  # a single message longer than the context
    assert "does not fit the context" in out.getvalue()


def _read_until(fd: int, pattern: str, buf: list[str], timeout: float) -> str:
    """Read the pseudo-terminal until `pattern` (a regex) appears after what `buf` already holds."""
    start = len("".join(buf))
    deadline = time.monotonic() + timeout
    while True:
        text = "".join(buf)
        if re.search(pattern, text[start:]):
            return text[start:]
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"no {pattern!r} within {timeout}s; output so far:\n{text}")
        ready, _, _ = select.select([fd], [], [], min(left, 1.0))
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # the child closed the terminal
                chunk = b""
            if not chunk:
                raise AssertionError(f"terminal closed before {pattern!r}; output:\n{text}")
            buf.append(chunk.decode("utf-8", errors="replace"))


@pytest.mark.timeout(300)
def test_chat_in_a_terminal(tiny_llama_dir: Path) -> None:
    """Two turns, /reset, a third turn and /exit, typed into a pseudo-terminal; each reply ends with its stats."""
    master, slave = os.openpty()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1",
           "TERM": "dumb"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "specdecode.cli", "chat", "--model", str(tiny_llama_dir), "--dtype", "fp32",
         "--device", "cpu", "--method", "ngram", "--max-tokens", "6", "--system", "Be brief."],
        stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True,
    )
    os.close(slave)
    buf: list[str] = []
    try:
        _read_until(master, r">>> ", buf, timeout=180)  # start-up: imports and the model load
        contexts = []
        for line in ("hello", "how are you", "/reset", "hello"):
            os.write(master, (line + "\n").encode())
            if line == "/reset":
                _read_until(master, r"conversation cleared[\s\S]*>>> ", buf, timeout=60)
                continue
            reply = _read_until(master, STATS.pattern + r"[\s\S]*>>> ", buf, timeout=60)
            contexts.append(int(STATS.search(reply).group(3)))
        assert contexts[1] > contexts[0] and contexts[2] == contexts[0]  # history kept, then cleared
        os.write(master, b"/exit\n")
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        os.close(master)
    assert "Traceback" not in "".join(buf)


def test_chat_exits_on_end_of_input(tiny_llama_dir: Path) -> None:
    """Ctrl-D (end of input) quits with status 0 too; piped input works without a terminal."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    res = subprocess.run(
        [sys.executable, "-m", "specdecode.cli", "chat", "--model", str(tiny_llama_dir), "--dtype", "fp32",
         "--device", "cpu", "--max-tokens", "4"],
        input="hello\n", capture_output=True, text=True, timeout=240, env=env, check=False,
    )
    assert res.returncode == 0, res.stderr
    assert len(STATS.findall(res.stdout)) == 1, res.stdout
