"""`ORG/NAME:QUANT` picks the repo's GGUF of that quantization (llama.cpp's `-hf ORG/NAME:Q4_K_M`), from a fake
offline hub cache or from a faked Hub listing: a test never reaches the network."""

from __future__ import annotations

import argparse
from pathlib import Path

import huggingface_hub
import pytest
from hub_helpers import offline_cache, put_in_cache

from specdecode.cli import main
from specdecode.fetch import fetch_model, resolve_model
from specdecode.hub import HubRef, UnknownModelError, parse_hub_id, pick_quant


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return offline_cache(tmp_path, monkeypatch)


def _files(tmp_path: Path, *names: str) -> dict[str, Path]:
    out = {}
    for name in names:
        src = tmp_path / "src" / name.replace("/", "--")
        src.parent.mkdir(exist_ok=True)
        src.write_bytes(b"GGUF" + name.encode())
        out[name] = src
    return out


def test_parse_quant_tag() -> None:
    ref = parse_hub_id("bartowski/Qwen2.5-Coder-1.5B-Instruct-GGUF@main:Q4_K_M")
    assert ref is not None and ref.quant == "Q4_K_M" and ref.revision == "main"
    assert str(ref) == "bartowski/Qwen2.5-Coder-1.5B-Instruct-GGUF@main:Q4_K_M"
    assert parse_hub_id("org/r:m-Q4_K_M.gguf").quant is None  # a file name, not a tag
    assert parse_hub_id("org/r:UD-Q4_K_XL").quant == "UD-Q4_K_XL"
    assert parse_hub_id("org/r:not a tag") is None


def test_pick_quant_words_case_and_splits() -> None:
    files = ["m-Q4_K_M.gguf", "m-Q4_K_S.gguf", "m-IQ4_XS.gguf", "m-Q4_0.gguf", "m-Q4_0_4_4.gguf", "README.md",
             "mmproj-m-f16.gguf", "m-F16.gguf",
             "Q8_0/m-Q8_0-00002-of-00003.gguf", "Q8_0/m-Q8_0-00001-of-00003.gguf", "Q8_0/m-Q8_0-00003-of-00003.gguf"]
    pick = lambda tag: pick_quant(HubRef("org/r", None, tag), files)  # noqa: E731
    assert pick("Q4_K_M") == ["m-Q4_K_M.gguf"]
    assert pick("q4_k_m") == ["m-Q4_K_M.gguf"]  # case-insensitive
    assert pick("Q4_0") == ["m-Q4_0.gguf"]  # not Q4_0_4_4
    assert pick("IQ4_XS") == ["m-IQ4_XS.gguf"]
    assert pick("F16") == ["m-F16.gguf"]  # never the vision projector
    assert pick("Q8_0") == [f"Q8_0/m-Q8_0-0000{i}-of-00003.gguf" for i in (1, 2, 3)]  # first part first
    with pytest.raises(UnknownModelError) as info:
        pick("Q4_K")  # a whole word only: neither Q4_K_M nor Q4_K_S
    msg = str(info.value)
    assert "no Q4_K GGUF" in msg
    for quant in ("Q4_K_M", "Q4_K_S", "IQ4_XS", "Q4_0", "Q4_0_4_4", "F16", "Q8_0"):
        assert quant in msg
    assert "MMPROJ" not in msg.upper()


def test_ambiguous_tag_is_refused_naming_the_files() -> None:
    with pytest.raises(UnknownModelError, match=r"matches 2 GGUF files \(a-Q4_K_M\.gguf, b-Q4_K_M\.gguf\)"):
        pick_quant(HubRef("org/r", None, "Q4_K_M"), ["a-Q4_K_M.gguf", "b-Q4_K_M.gguf", "a-Q8_0.gguf"])
    with pytest.raises(UnknownModelError, match=r"no \.gguf file"):
        pick_quant(HubRef("org/r", None, "Q4_K_M"), [])


def test_quant_from_offline_cache(hub: Path, tmp_path: Path) -> None:
    put_in_cache(hub, "org/r", _files(tmp_path, "r-Q4_K_M.gguf", "r-Q8_0.gguf", "Q6_K/r-Q6_K-00001-of-00002.gguf",
                                      "Q6_K/r-Q6_K-00002-of-00002.gguf"))
    path = resolve_model("org/r:q8_0")
    assert path.name == "r-Q8_0.gguf" and path.read_bytes() == b"GGUFr-Q8_0.gguf"
    first = resolve_model("org/r:Q6_K")
    assert first.name == "r-Q6_K-00001-of-00002.gguf" and (first.parent / "r-Q6_K-00002-of-00002.gguf").is_file()
    with pytest.raises(UnknownModelError, match=r"org/r has no Q2_K GGUF file.*Q4_K_M, Q6_K, Q8_0"):
        resolve_model("org/r:Q2_K")
    assert fetch_model("org/r:Q4_K_M").name == "r-Q4_K_M.gguf"  # `specdecode fetch ORG/NAME:QUANT`


def test_cli_fetch_quant_and_gguf_file_flag(hub: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    put_in_cache(hub, "org/r", _files(tmp_path, "r-Q4_K_M.gguf", "r-Q8_0.gguf"))
    assert main(["fetch", "org/r:Q4_K_M"]) == 0
    assert capsys.readouterr().out.strip().endswith("r-Q4_K_M.gguf")
    assert main(["fetch", "org/r:Q5_K_M"]) == 2
    assert "Q4_K_M, Q8_0" in capsys.readouterr().err

    from specdecode.cli_args import add_model_args

    p = argparse.ArgumentParser()
    add_model_args(p)
    assert p.parse_args(["--model", "org/r", "--gguf-file", "Q4_K_M"]).model == "org/r:Q4_K_M"


def test_quant_lists_the_hub_and_downloads_only_the_match(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the Hub answers, its file list is read and only the chosen file(s) downloaded (faked here)."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    listed: list[str] = []
    fetched: list[str] = []

    def list_repo_files(self: object, repo_id: str, *, revision: str | None = None, **kw: object) -> list[str]:
        listed.append(f"{repo_id}@{revision}")
        return ["README.md", "x-Q4_K_M.gguf", "x-Q8_0-00001-of-00002.gguf", "x-Q8_0-00002-of-00002.gguf"]

    def hf_hub_download(*, repo_id: str, filename: str, revision: str | None, cache_dir: str,
                        local_files_only: bool, **kw: object) -> str:
        assert not local_files_only
        fetched.append(filename)
        out = Path(cache_dir) / filename
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(b"GGUF")
        return str(out)

    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", list_repo_files)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    assert resolve_model("org/x@v1:Q8_0").name == "x-Q8_0-00001-of-00002.gguf"
    assert listed == ["org/x@v1"] and fetched == ["x-Q8_0-00001-of-00002.gguf", "x-Q8_0-00002-of-00002.gguf"]
