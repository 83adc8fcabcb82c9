"""Hugging Face ids resolve through huggingface_hub's cache, offline: a test never reaches the network."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pytest
from hub_helpers import SHA, offline_cache, put_in_cache

from specdecode import LLM, SamplingParams
from specdecode.fetch import resolve_model
from specdecode.hub import ModelNotCachedError, UnknownModelError, parse_hub_id, resolve_hub

SHA2 = "fedcba9876543210fedcba9876543210fedcba98"


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return offline_cache(tmp_path, monkeypatch)


def test_parse_hub_id() -> None:
    assert parse_hub_id("Qwen/Qwen2.5-Coder-1.5B-Instruct") is not None
    ref = parse_hub_id("Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF@v1:qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")
    assert ref is not None and ref.revision == "v1" and ref.gguf_file.endswith("q4_k_m.gguf")
    assert str(ref) == "Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF@v1:qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
    for not_id in ("/abs/path", "./rel/dir", "model.gguf", "qwen2.5-coder-1.5b-instruct", "a/b/c", "../x",
                   "models/missing.gguf"):
        assert parse_hub_id(not_id) is None, not_id


def test_llm_loads_hub_id_from_offline_cache(hub: Path, tiny_llama_dir: Path) -> None:
    put_in_cache(hub, "org/tiny", tiny_llama_dir)
    assert resolve_model("org/tiny") == hub / "models--org--tiny" / "snapshots" / SHA
    llm = LLM(model="org/tiny", dtype="fp32", device="cpu")
    ref = LLM(str(tiny_llama_dir), dtype="fp32", device="cpu")
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    assert llm.generate("def add(a, b):", params)[0].token_ids == ref.generate("def add(a, b):", params)[0].token_ids


def test_hub_cache_env_and_revision(tmp_path: Path, hub: Path, tiny_llama_dir: Path, tiny_qwen_dir: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    other = tmp_path / "elsewhere"
    monkeypatch.setenv("HF_HUB_CACHE", str(other))  # wins over HF_HOME
    put_in_cache(other, "org/tiny", tiny_llama_dir)
    (other / "models--org--tiny" / "refs" / "v2").write_text(SHA2)
    put_in_cache(other, "org/tiny", tiny_qwen_dir, sha=SHA2, ref=None)
    assert resolve_model("org/tiny").name == SHA
    assert resolve_model("org/tiny@v2").name == SHA2
    assert resolve_model(f"org/tiny@{SHA2}").name == SHA2
    assert LLM("org/tiny@v2", dtype="fp32", device="cpu").target.config.arch == "qwen2"


def test_missing_hub_id_says_not_cached_and_how_to_fetch(hub: Path) -> None:
    with pytest.raises(ModelNotCachedError) as info:
        LLM(model="org/absent", dtype="fp32", device="cpu")
    msg = str(info.value)
    assert "org/absent" in msg and "nor in the local Hugging Face cache" in msg and str(hub) in msg
    assert "HF_HUB_OFFLINE" in msg and "hf download org/absent" in msg
    assert isinstance(info.value, UnknownModelError) and isinstance(info.value, ValueError)
    with pytest.raises(ModelNotCachedError, match="org/absent@v9"):
        resolve_model("org/absent@v9")


def test_gguf_inside_a_hub_repo(hub: Path, tmp_path: Path) -> None:
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"GGUF-a")
    b.write_bytes(b"GGUF-b")
    put_in_cache(hub, "org/one-gguf", {"m-Q4_K_M.gguf": a, "README.md": a})
    put_in_cache(hub, "org/two-gguf", {"m-Q4_K_M.gguf": a, "m-Q8_0.gguf": b})
    one = resolve_model("org/one-gguf")  # the only GGUF of the repo
    assert one.name == "m-Q4_K_M.gguf" and one.read_bytes() == b"GGUF-a"
    two = resolve_model("org/two-gguf:m-Q8_0.gguf")
    assert two.name == "m-Q8_0.gguf" and two.read_bytes() == b"GGUF-b"
    with pytest.raises(UnknownModelError, match=r"2 GGUF files.*m-Q4_K_M\.gguf.*--gguf-file"):
        resolve_model("org/two-gguf")
    with pytest.raises(ModelNotCachedError, match="m-Q2_K.gguf"):
        resolve_model("org/two-gguf:m-Q2_K.gguf")


def test_local_path_wins_over_hub_id(hub: Path, tiny_llama_dir: Path, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_llama_dir, tmp_path / "org" / "tiny")
    assert resolve_model("org/tiny") == Path("org/tiny")


def test_cli_revision_and_gguf_file_compose_the_model_name() -> None:
    from specdecode.cli_args import add_model_args

    p = argparse.ArgumentParser()
    add_model_args(p)
    assert p.parse_args(["--model", "org/tiny"]).model == "org/tiny"
    assert p.parse_args(["--model", "org/tiny", "--revision", "v2"]).model == "org/tiny@v2"
    assert p.parse_args(["--gguf-file", "m.gguf", "--model", "org/r"]).model == "org/r:m.gguf"
    assert p.parse_args(["--model", "org/r", "--gguf-file", "m.gguf", "--revision", "abc"]).model == "org/r@abc:m.gguf"
    assert p.parse_args([]).model == "qwen2.5-coder-1.5b-instruct"
    with pytest.raises(SystemExit):
        p.parse_args(["--model", "/some/dir", "--revision", "v2"])


def test_head_snapshot_keeps_bin_files(hub: Path, tmp_path: Path) -> None:
    f = tmp_path / "w.bin"
    f.write_bytes(b"x")
    put_in_cache(hub, "org/head", {"config.json": f, "pytorch_model.bin": f})
    from specdecode.hub import HEAD_FILES

    snap = resolve_hub("org/head", HEAD_FILES)
    assert (snap / "pytorch_model.bin").is_file()
