"""Hugging Face ids: `ORG/NAME`, `ORG/NAME@REVISION`, `ORG/NAME:FILE.gguf` (a GGUF inside a repo) and
`ORG/NAME:QUANT` (the repo's GGUF of that quantization, as llama.cpp's `-hf ORG/NAME:Q4_K_M`).

Resolution goes through `huggingface_hub` and its cache (`HF_HOME`, `HF_HUB_CACHE`, read when called, so a
process may point them elsewhere after import). With `HF_HUB_OFFLINE=1`, or when the Hub cannot be reached, the
local cache answers; a model that is not cached is refused saying so and how to fetch it.

`UnknownModelError` lives here, below `specdecode.fetch` (whose `resolve_model` maps every kind of model name and
raises it too).
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

__all__ = ["HubRef", "ModelNotCachedError", "UnknownModelError", "download_file", "hub_cache_dir", "hub_offline",
           "hub_reachable", "is_hub_id", "parse_hub_id", "pick_quant", "resolve_hub"]

_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]*[\w])(?:@(?P<rev>[^:@]+))?(?::(?P<file>[^:]+))?$",
                 re.IGNORECASE)
_QUANT = re.compile(r"^[A-Za-z0-9][\w.+-]*$")  # Q4_K_M, IQ4_XS, BF16, UD-Q4_K_XL, ...
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)  # llama.cpp's gguf-split naming

MODEL_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.tiktoken", "*.txt"]
"""What a model directory needs (never the repo's other formats: .bin, .gguf, onnx, ...)."""
HEAD_FILES = [*MODEL_FILES, "*.bin", "*.pt"]
"""Public EAGLE / Medusa heads ship `pytorch_model.bin` or `medusa_lm_head.pt` as often as safetensors."""


class UnknownModelError(ValueError):
    """The name is neither a known alias, a .gguf file, a Hugging Face model directory, nor a model on the Hub."""


class ModelNotCachedError(UnknownModelError):
    """A Hugging Face id that is not in the local cache while the Hub cannot be reached."""


@dataclass(frozen=True)
class HubRef:
    repo: str
    revision: str | None = None
    gguf_file: str | None = None
    """A `.gguf` file of the repo, or a quantization tag (`Q4_K_M`) choosing one."""

    @property
    def quant(self) -> str | None:
        return self.gguf_file if self.gguf_file and not self.gguf_file.lower().endswith(".gguf") else None

    def __str__(self) -> str:
        return self.repo + (f"@{self.revision}" if self.revision else "") + (f":{self.gguf_file}" if self.gguf_file
                                                                              else "")


def parse_hub_id(name: str) -> HubRef | None:
    m = _ID.match(name)
    if m is None or ".." in m["repo"] or m["repo"].lower().endswith(".gguf"):
        return None  # "dir/model.gguf" is a (missing) local file, not a repo
    file = m["file"]
    if file and not file.lower().endswith(".gguf") and not _QUANT.match(file):
        return None  # neither FILE.gguf nor a quantization tag
    return HubRef(m["repo"], m["rev"], file)


def is_hub_id(name: str) -> bool:
    return parse_hub_id(name) is not None


def _truthy(value: str | None) -> bool:
    return (value or "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def hub_offline() -> bool:
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")
    return _truthy(env) or bool(constants.HF_HUB_OFFLINE)


def hub_reachable(timeout: float = 3.0) -> bool:
    """False when offline or when the Hub's host takes no connection within `timeout` seconds: a quick answer
    where huggingface_hub itself would retry for half a minute before giving up."""
    if hub_offline():
        return False
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True  # only the proxy knows: let huggingface_hub try through it
    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname or "", url.port or (80 if url.scheme == "http" else 443)),
                                 timeout=timeout).close()
    except OSError:
        return False
    return True


def hub_cache_dir() -> Path:
    """The hub cache as huggingface_hub computes it, from the environment as it is now."""
    from huggingface_hub import constants

    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.path.expandvars(os.environ[var])).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.path.expandvars(os.environ["HF_HOME"])).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE)


def download_file(repo: str, filename: str, dest_dir: Path, *, progress: bool = True) -> Path:
    """Download one file of a repo into `dest_dir` (not the hub cache), with huggingface_hub's progress bar."""
    from huggingface_hub import hf_hub_download
    from tqdm.auto import tqdm

    class _Quiet(tqdm):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return Path(hf_hub_download(repo_id=repo, filename=filename, local_dir=dest_dir,
                                tqdm_class=None if progress else _Quiet))


def _fetch_hint(ref: HubRef) -> str:
    rev = f" --revision {ref.revision}" if ref.revision else ""
    what = f" {ref.gguf_file}" if ref.gguf_file and not ref.quant else f" --include '*{ref.quant}*'" if ref.quant \
        else ""
    return (f"download it where the Hub is reachable with `hf download {ref.repo}{what}{rev}` (huggingface_hub's CLI) "
            "and copy that Hugging Face cache here (set HF_HOME or HF_HUB_CACHE to it), or pass a local "
            "directory or .gguf path")


@contextmanager
def _hub_errors(ref: HubRef, filename: str | None = None) -> Iterator[None]:
    """Turn huggingface_hub's errors into ours, each naming what is missing."""
    from huggingface_hub import errors

    try:
        yield
    except errors.RepositoryNotFoundError:
        raise UnknownModelError(f"no model {ref.repo!r} on the Hugging Face Hub (or it is private or gated: log in "
                               "with `hf auth login`)") from None
    except errors.RevisionNotFoundError:
        raise UnknownModelError(f"{ref.repo!r} has no revision {ref.revision!r} on the Hugging Face Hub") from None
    except errors.LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if hub_offline() else "the Hugging Face Hub cannot be reached"
        raise ModelNotCachedError(f"{ref} is not a local path, nor in the local Hugging Face cache "
                                  f"({hub_cache_dir()}), and {why}; {_fetch_hint(ref)}") from None
    except errors.EntryNotFoundError:
        raise UnknownModelError(f"{ref.repo!r} has no file {filename!r}") from None


def _hub_call(ref: HubRef, fn: Any, *, local_only: bool | None = None, **kw: Any) -> Path:
    """Run a huggingface_hub download function on the hub cache (offline when HF_HUB_OFFLINE or `local_only`)."""
    with _hub_errors(ref, kw.get("filename")):
        return Path(fn(repo_id=ref.repo, revision=ref.revision, cache_dir=str(hub_cache_dir()),
                       local_files_only=hub_offline() if local_only is None else local_only, **kw))


def _repo_ggufs(ref: HubRef, snapshot: Path | None = None) -> list[str]:
    """The repo's .gguf files: the Hub's list where it answers, else what the cached snapshot holds."""
    if not hub_offline():
        from huggingface_hub import HfApi

        try:
            with _hub_errors(ref):
                files = HfApi().list_repo_files(ref.repo, revision=ref.revision)
            return sorted(f for f in files if f.lower().endswith(".gguf"))
        except UnknownModelError:
            raise
        except Exception:  # unreachable now: what the cache holds
            pass
    if snapshot is None:
        from huggingface_hub import snapshot_download

        snapshot = _hub_call(ref, snapshot_download, local_only=True, allow_patterns=["*.gguf"])
    return sorted(str(p.relative_to(snapshot)) for p in snapshot.rglob("*.gguf"))


def _stem(file: str) -> str:
    """A GGUF's name without `.gguf` and without a split suffix (`-00001-of-00002.gguf`)."""
    return _SPLIT.sub("", file) if _SPLIT.search(file) else file[: -len(".gguf")]


def pick_quant(ref: HubRef, files: list[str]) -> list[str]:
    """The GGUF file(s) of quantization `ref.quant` among a repo's `files`: one file, or every part of a split
    GGUF, first part first. The tag matches case-insensitively as a whole word of the name (`Q4_K` never picks
    `Q4_K_M`); vision projectors (`mmproj*`) are never picked."""
    tag = ref.quant or ""
    word = re.compile(rf"(?<![A-Za-z0-9]){re.escape(tag)}(?![A-Za-z0-9_])", re.IGNORECASE)
    models = [f for f in files if f.lower().endswith(".gguf") and not Path(f).name.lower().startswith("mmproj")]
    by_model: dict[str, list[str]] = {}
    for f in models:
        if word.search(_stem(f)):
            by_model.setdefault(_stem(f), []).append(f)
    if not by_model:
        # The quantization is the last word of a name: `...-Q4_K_M.gguf`, `....Q8_0-00001-of-00002.gguf`.
        present = sorted({re.split(r"[-./]", _stem(f))[-1].upper() for f in models})
        raise UnknownModelError(f"{ref.repo} has no {tag} GGUF file; the quantizations it holds: "
                                f"{', '.join(present) or 'none (no .gguf file)'}")
    if len(by_model) > 1:
        shown = ", ".join(sorted(parts[0] for parts in by_model.values()))
        raise UnknownModelError(f"{ref} matches {len(by_model)} GGUF files ({shown}); choose one with "
                                f"{ref.repo}:FILE.gguf")
    return sorted(next(iter(by_model.values())))


def resolve_hub(name: str | HubRef, allow_patterns: list[str] | None = None) -> Path:
    """A local path for a Hugging Face id: the cached snapshot directory (config.json + safetensors + tokenizer,
    or a head's files), or the cached .gguf file (the first part of a split one, its other parts beside it).
    Downloads what is missing unless offline."""
    from huggingface_hub import hf_hub_download, snapshot_download

    ref = parse_hub_id(name) if isinstance(name, str) else name
    if ref is None:
        raise UnknownModelError(f"{name!r} is not a Hugging Face id (ORG/NAME, ORG/NAME@REVISION, ORG/NAME:FILE.gguf, "
                                "ORG/NAME:QUANT)")
    if ref.quant:
        paths = [_hub_call(ref, hf_hub_download, filename=f) for f in pick_quant(ref, _repo_ggufs(ref))]
        return paths[0]
    if ref.gguf_file:
        return _hub_call(ref, hf_hub_download, filename=ref.gguf_file)
    snapshot = _hub_call(ref, snapshot_download, allow_patterns=allow_patterns or MODEL_FILES)
    if (snapshot / "config.json").is_file() and any(snapshot.glob("*.safetensors")):
        return snapshot
    if allow_patterns is not None:  # a head: its own layouts are checked by its loader
        return snapshot
    ggufs = _repo_ggufs(ref, snapshot)
    if len(ggufs) == 1:
        return _hub_call(HubRef(ref.repo, ref.revision, ggufs[0]), hf_hub_download, filename=ggufs[0])
    if ggufs:
        shown = ", ".join(ggufs[:12]) + (", ..." if len(ggufs) > 12 else "")
        raise UnknownModelError(f"{ref} holds {len(ggufs)} GGUF files ({shown}); choose one with {ref.repo}:QUANT "
                                f"(e.g. {ref.repo}:Q4_K_M), {ref.repo}:FILE.gguf or --gguf-file")
    raise UnknownModelError(f"{ref} ({snapshot}) has neither config.json with *.safetensors nor a .gguf file")
