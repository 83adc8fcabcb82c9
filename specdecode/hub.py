"""Hugging Face ids: `ORG/NAME`, `ORG/NAME@REVISION`, `ORG/NAME:FILE.gguf` (a GGUF inside a repo).

Resolution goes through `huggingface_hub` and its cache (`HF_HOME`, `HF_HUB_CACHE`, read when called, so a
process may point them elsewhere after import). With `HF_HUB_OFFLINE=1`, or when the Hub cannot be reached, the
local cache answers; a model that is not cached is refused saying so and how to fetch it.

`UnknownModelError` lives here, below `specdecode.fetch` (whose `resolve_model` maps every kind of model name and
raises it too).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["HubRef", "ModelNotCachedError", "UnknownModelError", "hub_cache_dir", "is_hub_id", "parse_hub_id",
           "resolve_hub"]

_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]*[\w])(?:@(?P<rev>[^:@]+))?(?::(?P<file>[^:]+\.gguf))?$",
                 re.IGNORECASE)

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

    def __str__(self) -> str:
        return self.repo + (f"@{self.revision}" if self.revision else "") + (f":{self.gguf_file}" if self.gguf_file
                                                                              else "")


def parse_hub_id(name: str) -> HubRef | None:
    m = _ID.match(name)
    if m is None or ".." in m["repo"] or m["repo"].lower().endswith(".gguf"):
        return None  # "dir/model.gguf" is a (missing) local file, not a repo
    return HubRef(m["repo"], m["rev"], m["file"])


def is_hub_id(name: str) -> bool:
    return parse_hub_id(name) is not None


def _truthy(value: str | None) -> bool:
    return (value or "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def hub_offline() -> bool:
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")
    return _truthy(env) or bool(constants.HF_HUB_OFFLINE)


def hub_cache_dir() -> Path:
    """The hub cache as huggingface_hub computes it, from the environment as it is now."""
    from huggingface_hub import constants

    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.path.expandvars(os.environ[var])).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.path.expandvars(os.environ["HF_HOME"])).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE)


def _fetch_hint(ref: HubRef) -> str:
    rev = f" --revision {ref.revision}" if ref.revision else ""
    what = f" {ref.gguf_file}" if ref.gguf_file else ""
    return (f"download it where the Hub is reachable with `hf download {ref.repo}{what}{rev}` (huggingface_hub's CLI) "
            "and copy that Hugging Face cache here (set HF_HOME or HF_HUB_CACHE to it), or pass a local "
            "directory or .gguf path")


def _hub_call(ref: HubRef, fn: Any, **kw: Any) -> Path:
    """Run a huggingface_hub download function, turning its errors into ours."""
    from huggingface_hub import errors

    offline = hub_offline()
    cache = hub_cache_dir()
    try:
        return Path(fn(repo_id=ref.repo, revision=ref.revision, cache_dir=str(cache), local_files_only=offline, **kw))
    except errors.RepositoryNotFoundError:
        raise UnknownModelError(f"no model {ref.repo!r} on the Hugging Face Hub (or it is private or gated: log in "
                               "with `hf auth login`)") from None
    except errors.RevisionNotFoundError:
        raise UnknownModelError(f"{ref.repo!r} has no revision {ref.revision!r} on the Hugging Face Hub") from None
    except errors.LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if offline else "the Hugging Face Hub cannot be reached"
        raise ModelNotCachedError(f"{ref} is not a local path, nor in the local Hugging Face cache ({cache}), and "
                                  f"{why}; {_fetch_hint(ref)}") from None
    except errors.EntryNotFoundError:
        raise UnknownModelError(f"{ref.repo!r} has no file {kw.get('filename')!r}") from None


def _gguf_files(ref: HubRef, snapshot: Path | None) -> list[str]:
    if hub_offline() or snapshot is None:
        return sorted(str(p.relative_to(snapshot)) for p in snapshot.rglob("*.gguf")) if snapshot else []
    try:
        from huggingface_hub import HfApi

        return sorted(f for f in HfApi().list_repo_files(ref.repo, revision=ref.revision) if f.endswith(".gguf"))
    except Exception:  # unreachable now: what the cache holds
        return sorted(str(p.relative_to(snapshot)) for p in snapshot.rglob("*.gguf"))


def resolve_hub(name: str | HubRef, allow_patterns: list[str] | None = None) -> Path:
    """A local path for a Hugging Face id: the cached snapshot directory (config.json + safetensors + tokenizer,
    or a head's files), or the cached .gguf file. Downloads what is missing unless offline."""
    from huggingface_hub import hf_hub_download, snapshot_download

    ref = parse_hub_id(name) if isinstance(name, str) else name
    if ref is None:
        raise UnknownModelError(f"{name!r} is not a Hugging Face id (ORG/NAME, ORG/NAME@REVISION, ORG/NAME:FILE.gguf)")
    if ref.gguf_file:
        return _hub_call(ref, hf_hub_download, filename=ref.gguf_file)
    snapshot = _hub_call(ref, snapshot_download, allow_patterns=allow_patterns or MODEL_FILES)
    if (snapshot / "config.json").is_file() and any(snapshot.glob("*.safetensors")):
        return snapshot
    if allow_patterns is not None:  # a head: its own layouts are checked by its loader
        return snapshot
    ggufs = _gguf_files(ref, snapshot)
    if len(ggufs) == 1:
        return _hub_call(HubRef(ref.repo, ref.revision, ggufs[0]), hf_hub_download, filename=ggufs[0])
    if ggufs:
        shown = ", ".join(ggufs[:12]) + (", ..." if len(ggufs) > 12 else "")
        raise UnknownModelError(f"{ref} holds {len(ggufs)} GGUF files ({shown}); choose one with {ref.repo}:FILE.gguf "
                               "or --gguf-file FILE.gguf")
    raise UnknownModelError(f"{ref} ({snapshot}) has neither config.json with *.safetensors nor a .gguf file")
