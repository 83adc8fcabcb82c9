"""The `specdecode` logger: one line with its time for each long step (GGUF conversion, kernel compilation,
start-up cost measurement), no handler from the library, and the command line's -v / -q."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
from gguf_helpers import write_tiny_gguf

from specdecode import LLM, SamplingParams
from specdecode.cli import main
from specdecode.native_build import BuildError, build_shared, find_compiler

TIMED = r"in \d+\.\d\d s"


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty SPECDECODE_HOME: nothing converted or compiled yet."""
    monkeypatch.setenv("SPECDECODE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture(scope="module")
def tiny_gguf(tiny_qwen_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tiny_qwen_dir, tmp_path_factory.mktemp("gguf") / "tiny-qwen.gguf")


def _lines(caplog: pytest.LogCaptureFixture, pattern: str, level: int | None = None) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if re.search(pattern, r.getMessage()) and (level is None or r.levelno == level)]


def test_first_gguf_conversion_logs_once_with_its_time(home: Path, tiny_gguf: Path, tiny_qwen_dir: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="specdecode")
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    out = LLM(str(tiny_gguf), dtype="fp32", device="cpu").generate("def add(a, b):", params)[0]
    converted = _lines(caplog, rf"^converted tiny-qwen\.gguf to float32 .*{TIMED}$", logging.INFO)
    assert len(converted) == 1, caplog.text
    assert len(_lines(caplog, rf"^loaded .*tiny-qwen\.gguf \(float32, cpu\) {TIMED}$")) == 1
    caplog.clear()
    LLM(str(tiny_gguf), dtype="fp32", device="cpu")  # converted already: loads the cached copy
    assert not _lines(caplog, "^converted"), caplog.text
    # The GGUF holds the checkpoint's weights and vocabulary: the same output as the HF directory.
    ref = LLM(str(tiny_qwen_dir), dtype="fp32", device="cpu").generate("def add(a, b):", params)[0]
    assert out.token_ids == ref.token_ids


def test_kernel_compilation_logs_its_time(home: Path, caplog: pytest.LogCaptureFixture) -> None:
    if find_compiler(cxx=False) is None:
        pytest.skip("no C compiler")
    caplog.set_level(logging.DEBUG, logger="specdecode")
    source = "int specdecode_probe(void) { return 7; }\n"
    path = build_shared(source, "probe", ["-O0"])
    assert path.is_file()
    assert len(_lines(caplog, rf"^compiled probe \(once; cached in .*\) {TIMED}$", logging.INFO)) == 1
    caplog.clear()
    assert build_shared(source, "probe", ["-O0"]) == path  # cached: nothing compiled, nothing logged
    assert not caplog.records
    with pytest.raises(BuildError):
        build_shared("this is not C", "broken", ["-O0"])
    assert not _lines(caplog, "^compiled broken")  # a failed build logs no success line


def test_cost_measurement_logs_its_time(tiny_llama_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="specdecode")
    LLM(str(tiny_llama_dir), dtype="fp32", device="cpu", speculative_config={"method": "ngram"})
    assert len(_lines(caplog, rf"^measured the target's forward costs .*{TIMED}, 1-token forward [\d.]+ ms$")) == 1
    caplog.clear()
    LLM(str(tiny_llama_dir), dtype="fp32", device="cpu",
        speculative_config={"method": "ngram", "num_speculative_tokens": 3})  # a fixed k measures nothing
    assert not _lines(caplog, "^measured")


def test_library_installs_no_handler(tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert logging.getLogger("specdecode").handlers == []
    rc = main(["generate", "--model", str(tiny_llama_dir), "--dtype", "fp32", "--device", "cpu", "--max-tokens", "2",
               "hi"])
    assert rc == 0
    assert logging.getLogger("specdecode").handlers == []  # the command's handler is gone after it
    capsys.readouterr()


@pytest.mark.parametrize(("flags", "shown"), [([], {"converted"}), (["-v"], {"converted", "loaded"}),
                                              (["-q"], set())])
def test_cli_verbosity(home: Path, tiny_gguf: Path, capsys: pytest.CaptureFixture[str], flags: list[str],
                       shown: set[str]) -> None:
    """Default: the long steps (a first conversion always counts); -v: every step; -q: none."""
    rc = main(["generate", *flags, "--model", str(tiny_gguf), "--dtype", "fp32", "--device", "cpu",
               "--max-tokens", "2", "--ignore-eos", "hi"])
    err = capsys.readouterr().err
    assert rc == 0, err
    logged = {m.group(1) for m in re.finditer(r"^specdecode: (\w+) ", err, re.M)}
    assert "converted" in shown or "converted" not in logged
    assert shown <= logged, err
    if "-q" in flags:
        assert not logged and "converting" not in err, err  # no log line and no progress bar
