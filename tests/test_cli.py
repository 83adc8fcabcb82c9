"""The command line, run in-process (`specdecode.cli.main([...])`) on tiny model directories."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from specdecode.cli import main
from specdecode.fetch import KNOWN_MODELS

FOUNDATION_KEYS = {"prompt_tokens", "output_tokens", "seconds", "tokens_per_second", "prefill_seconds"}
SPEC_KEYS = {"steps", "draft_tokens", "accepted_tokens", "mean_accepted_length", "acceptance_rate",
             "acceptance_by_position"}
PROMPT = "def add(a, b):"


@pytest.fixture(autouse=True)
def _two_threads() -> None:
    """Overrides conftest's: one thread (tiny models; a second OpenMP thread only slows a loaded machine)."""
    torch.set_num_threads(1)


def run_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    rc = main(["generate", "--dtype", "fp32", "--device", "cpu", "--json", *args])
    out, err = capsys.readouterr()
    assert rc == 0, err
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert len(lines) == 1, out  # exactly one JSON object, nothing else on stdout
    return json.loads(lines[0])


def run_error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    rc = main(list(args))
    out, err = capsys.readouterr()
    assert rc == 2, (out, err)
    assert "Traceback" not in err and "Traceback" not in out
    assert err.startswith("specdecode: error: ")
    return err


def summary_lines(err: str) -> list[str]:
    """stderr without the log lines of long steps ("specdecode: loaded ... in 1.20 s" on a slow machine)."""
    return [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("specdecode: ")]


def check_record(rec: dict[str, Any], max_tokens: int) -> None:
    assert set(rec) >= {"text", "token_ids", "stats"}
    assert isinstance(rec["text"], str)
    assert len(rec["token_ids"]) <= max_tokens and all(isinstance(t, int) for t in rec["token_ids"])
    stats = rec["stats"]
    assert FOUNDATION_KEYS | SPEC_KEYS <= set(stats)
    assert stats["output_tokens"] == len(rec["token_ids"])
    assert 0 <= stats["accepted_tokens"] <= stats["draft_tokens"]


def test_generate_json_plain(tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rec = run_json(capsys, "--model", str(tiny_llama_dir), "--max-tokens", "8", "--ignore-eos", PROMPT)
    check_record(rec, 8)
    assert len(rec["token_ids"]) == 8 and rec["finish_reason"] == "length"
    assert rec["stats"]["steps"] == 8 and rec["stats"]["draft_tokens"] == 0
    from specdecode import LLM, SamplingParams

    ref = LLM(str(tiny_llama_dir), dtype="fp32", device="cpu").generate(
        PROMPT, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    assert rec["token_ids"] == ref.token_ids and rec["text"] == ref.text


def test_generate_json_ngram(tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plain = run_json(capsys, "--model", str(tiny_llama_dir), "--max-tokens", "8", "--ignore-eos", PROMPT)
    rec = run_json(capsys, "--model", str(tiny_llama_dir), "--max-tokens", "8", "--ignore-eos",
                   "--method", "ngram", PROMPT)
    check_record(rec, 8)
    assert rec["token_ids"] == plain["token_ids"]


def test_generate_json_draft(
    tiny_llama_dir: Path, tiny_llama_other_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plain = run_json(capsys, "--model", str(tiny_llama_dir), "--max-tokens", "8", "--ignore-eos", PROMPT)
    rec = run_json(capsys, "--model", str(tiny_llama_dir), "--max-tokens", "8", "--ignore-eos",
                   "--draft", str(tiny_llama_other_dir), "--num-speculative-tokens", "3", PROMPT)
    check_record(rec, 8)
    assert rec["token_ids"] == plain["token_ids"]
    assert rec["stats"]["draft_tokens"] > 0
    assert len(rec["stats"]["acceptance_by_position"]) == 3


def test_generate_json_speculative_config(tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = {"method": "draft", "model": str(tiny_llama_dir), "num_speculative_tokens": 4, "draft_dtype": "fp32"}
    rec = run_json(capsys, "--model", str(tiny_llama_dir), "--max-tokens", "11", "--ignore-eos",
                   "--speculative-config", json.dumps(cfg), PROMPT)
    check_record(rec, 11)
    stats = rec["stats"]
    assert stats["acceptance_rate"] == 1.0 and stats["steps"] == 3  # prefill + 2 blocks of 5
    assert stats["mean_accepted_length"] == pytest.approx(11 / 3)


def test_generate_chat_with_sampling(tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rec = run_json(capsys, "--model", str(tiny_llama_dir), "--max-tokens", "6", "--chat", "--method", "ngram",
                   "--temperature", "0.8", "--top-k", "20", "--seed", "1", "hello")
    check_record(rec, 6)
    assert rec["stats"]["prompt_tokens"] > 4  # the template wrapped the prompt


def test_generate_plain_text_mode(tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rec = run_json(capsys, "--model", str(tiny_llama_dir), "--max-tokens", "8", "--ignore-eos", PROMPT)
    rc = main(["generate", "--model", str(tiny_llama_dir), "--dtype", "fp32", "--device", "cpu",
               "--max-tokens", "8", "--ignore-eos", PROMPT])
    out, err = capsys.readouterr()
    assert rc == 0
    assert out == rec["text"]  # streamed text, nothing else on stdout
    summary = summary_lines(err)
    assert len(summary) == 1, err
    assert "8 tokens" in summary[0] and "tok/s" in summary[0]
    # With speculation the summary also reports the method's numbers.
    rc = main(["generate", "--model", str(tiny_llama_dir), "--dtype", "fp32", "--device", "cpu",
               "--max-tokens", "8", "--ignore-eos", "--method", "ngram", PROMPT])
    out, err = capsys.readouterr()
    assert rc == 0 and out == rec["text"]
    summary = summary_lines(err)
    assert len(summary) == 1 and "ngram" in summary[0] and "acceptance" in summary[0]


def test_generate_runs_until_the_end_of_the_context_by_default(
    tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No --max-tokens: generation runs until EOS, bounded by the context (max_model_len minus the prompt)."""
    rec = run_json(capsys, "--model", str(tiny_llama_dir), "--max-model-len", "40", "--ignore-eos", PROMPT)
    assert rec["finish_reason"] == "length"
    assert rec["stats"]["prompt_tokens"] + len(rec["token_ids"]) == 40
    capped = run_json(capsys, "--model", str(tiny_llama_dir), "--max-model-len", "40", "--ignore-eos",
                      "--max-tokens", "5", PROMPT)
    assert capped["token_ids"] == rec["token_ids"][:5]
    eos = run_json(capsys, "--model", str(tiny_llama_dir), "--max-model-len", "40", "--stop", rec["text"][8:12],
                   PROMPT)
    assert eos["finish_reason"] == "stop" and len(eos["token_ids"]) < len(rec["token_ids"])


def test_prompt_that_fills_the_context(tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = run_error(capsys, "generate", "--model", str(tiny_llama_dir), "--dtype", "fp32", "--max-model-len", "8",
                    PROMPT * 4)
    assert "fills the context length 8" in err and "--max-model-len" in err


# ---- errors: exit code 2, one message, no traceback ---------------------------------------------


def test_unknown_alias(capsys: pytest.CaptureFixture[str]) -> None:
    err = run_error(capsys, "generate", "--model", "no-such-model-xyz", "hi")
    assert "no-such-model-xyz" in err
    for alias in KNOWN_MODELS:
        assert alias in err
    err = run_error(capsys, "fetch", "no-such-model-xyz")
    assert all(alias in err for alias in KNOWN_MODELS)


def test_unknown_draft_alias(tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = run_error(capsys, "generate", "--model", str(tiny_llama_dir), "--dtype", "fp32", "--draft",
                    "no-such-draft", "hi")
    assert "no-such-draft" in err


@pytest.mark.parametrize("bad", ["{not json", "[1, 2]", '{"method": "lookahead"}', '{"num_speculative_tokens": 99}',
                                 '{"bogus_key": 1}'])
def test_bad_speculative_config(tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str], bad: str) -> None:
    err = run_error(capsys, "generate", "--model", str(tiny_llama_dir), "--dtype", "fp32",
                    "--speculative-config", bad, "hi")
    assert "speculative" in err or "num_speculative_tokens" in err


def test_head_method_without_a_head_names_the_fix(tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = run_error(capsys, "generate", "--model", str(tiny_llama_dir), "--dtype", "fp32",
                    "--speculative-config", '{"method": "medusa"}', "hi")
    assert "no head ships for this target" in err and "train-head" in err


def test_bad_num_speculative_tokens(tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = run_error(capsys, "generate", "--model", str(tiny_llama_dir), "--dtype", "fp32", "--method", "ngram",
                    "--num-speculative-tokens", "many", "hi")
    assert "--num-speculative-tokens" in err and "many" in err


def test_prompt_too_long(tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = run_error(capsys, "generate", "--model", str(tiny_llama_dir), "--dtype", "fp32", "--max-tokens",
                    "100000", "hi")
    assert "100000" in err and "context" in err


def test_incompatible_draft(tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "swapped"
    shutil.copytree(tiny_llama_dir, bad)
    data = json.loads((bad / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    by_id = {i: s for s, i in vocab.items()}
    vocab[by_id[40]], vocab[by_id[41]] = 41, 40
    (bad / "tokenizer.json").write_text(json.dumps(data))
    # Another vocabulary drafts through text, but only chains: a tree is refused naming both models and ids.
    spec = json.dumps({"method": "draft", "model": str(bad), "draft_tree_width": 2})
    err = run_error(capsys, "generate", "--model", str(tiny_llama_dir), "--dtype", "fp32", "--speculative-config",
                    spec, "hi")
    assert str(bad) in err and str(tiny_llama_dir) in err and "first differing ids: 40: target" in err
    assert "chains only" in err


def test_bad_sampling_value(tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = run_error(capsys, "generate", "--model", str(tiny_llama_dir), "--dtype", "fp32", "--top-p", "0", "hi")
    assert "top_p" in err


def test_help_lists_subcommands() -> None:
    res = subprocess.run([sys.executable, "-m", "specdecode.cli", "--help"], capture_output=True, text=True,
                         timeout=120, check=False)
    assert res.returncode == 0, res.stderr
    for cmd in ("fetch", "generate", "bench"):
        assert cmd in res.stdout


def test_generate_help_in_process(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["generate", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--speculative-config", "--draft", "--method", "--num-speculative-tokens", "--json", "--chat"):
        assert flag in out
