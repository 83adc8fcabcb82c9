"""A local fake of the Hugging Face Hub: its cache layout, as huggingface_hub writes it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from huggingface_hub import constants

SHA = "0123456789abcdef0123456789abcdef01234567"


def put_in_cache(cache: Path, repo: str, files: Path | dict[str, Path], sha: str = SHA,
                 ref: str | None = "main") -> Path:
    """The hub cache layout (models--ORG--NAME/{blobs, refs/REF, snapshots/SHA}) as huggingface_hub writes it."""
    root = cache / ("models--" + repo.replace("/", "--"))
    snap = root / "snapshots" / sha
    snap.mkdir(parents=True)
    items = {f.name: f for f in files.iterdir() if f.is_file()} if isinstance(files, Path) else files
    (root / "blobs").mkdir(exist_ok=True)
    for name, src in items.items():
        blob = root / "blobs" / f"{sha[:8]}-{name.replace('/', '--')}"
        shutil.copyfile(src, blob)
        (snap / name).parent.mkdir(parents=True, exist_ok=True)
        (snap / name).symlink_to(Path("../" * (name.count("/") + 2) + "blobs") / blob.name)
    if ref is not None:
        (root / "refs").mkdir(exist_ok=True)
        (root / "refs" / ref).write_text(sha)
    return snap


def offline_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty offline hub cache under HF_HOME (HF_HUB_CACHE unset: HF_HOME/hub is used)."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # belt and braces: no request can leave
    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    return cache
