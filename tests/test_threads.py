"""`--threads N` on every command that runs a model: parsed, applied once before the command runs (torch's count,
which the native kernels read), defaulted from $OMP_NUM_THREADS or the physical cores, and recorded by `bench`."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import psutil
import pytest
import torch

from specdecode import chat_cli, generate_cli, serve_cli, train_cli
from specdecode.bench import cli as bench_cli
from specdecode.cli import build_parser, main
from specdecode.cli_args import default_threads  # the real one: conftest patches the module's for in-process runs

COMMANDS = {
    "generate": (generate_cli, "run_generate_command", ["generate", "hi"]),
    "chat": (chat_cli, "run_chat_command", ["chat"]),
    "serve": (serve_cli, "run_serve_command", ["serve"]),
    "bench": (bench_cli, "run_bench_command", ["bench", "--out", "x"]),
    "train-head": (train_cli, "run_train_head", ["train-head", "--out", "x"]),
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_threads_parses_on_every_command_that_runs_a_model(command: str) -> None:
    argv = COMMANDS[command][2]
    assert build_parser().parse_args([*argv, "--threads", "3"]).threads == 3
    assert build_parser().parse_args(argv).threads is None  # resolved when applied


def test_fetch_has_no_threads() -> None:
    assert not hasattr(build_parser().parse_args(["fetch", "smollm2-135m-instruct"]), "threads")


@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_a_bad_thread_count_is_refused_by_name(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["generate", "hi", "--threads", value])
    assert exc.value.code == 2
    assert "--threads" in capsys.readouterr().err


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_threads_are_applied_before_the_command_runs(command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    module, func, argv = COMMANDS[command]
    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)

    def fake(args: argparse.Namespace) -> int:
        calls.append(-1)  # the command starts after the threads are set
        return 0

    monkeypatch.setattr(module, func, fake)
    assert main([*argv, "--threads", "3"]) == 0
    assert calls == [3, -1]
    calls.clear()
    monkeypatch.setattr("specdecode.cli_args.default_threads", lambda: 5)
    assert main(argv) == 0
    assert calls == [5, -1]


def test_default_threads_are_omp_num_threads_else_the_physical_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert default_threads() == 3
    for unset in ("", "0", "auto"):
        monkeypatch.setenv("OMP_NUM_THREADS", unset)
        assert default_threads() == (psutil.cpu_count(logical=False) or os.cpu_count())
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: None)  # where psutil cannot tell
    assert default_threads() == os.cpu_count()


def test_bench_records_the_threads(tiny_llama_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"category": "code", "turns": ["def add(a, b):"]}) + "\n")
    out = tmp_path / "out"
    rc = main(["bench", "--model", str(tiny_llama_dir), "--methods", "plain", "--dataset", str(data),
               "--max-tokens", "2", "--dtype", "fp32", "--device", "cpu", "--bandwidth-gb", "0", "--no-warmup",
               "--no-peak-rss-alone", "--no-plots", "--no-progress", "--threads", "2", "--out", str(out)])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["machine"]["torch_threads"] == 2
    assert "--threads 2" in summary["command"]
