"""Save and load heads: `head.safetensors` (trained weights + draft vocabulary) and `config.json`."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specdecode.heads.config import HeadConfig
from specdecode.heads.modules import DraftHead, IncompatibleHeadError, build_head
from specdecode.model.transformer import Transformer

WEIGHTS = "head.safetensors"
CONFIG = "config.json"


def save_head(head: DraftHead, out_dir: Path, dtype: torch.dtype | None = None) -> None:
    """dtype: cast floating weights (e.g. bf16 to halve the file; a head's precision never changes the
    output, only how often its guesses are accepted)."""
    state = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().contiguous().cpu()
             for k, v in head.saved_state().items()}
    write_head_files(state, head.config, out_dir)


def write_head_files(state: dict[str, torch.Tensor], cfg: HeadConfig, out_dir: Path) -> None:
    """The weights file (written aside, then renamed: never half a file) and the config."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / (WEIGHTS + ".partial")
    save_file(state, str(tmp), metadata={"kind": cfg.kind})
    tmp.rename(out_dir / WEIGHTS)
    (out_dir / CONFIG).write_text(json.dumps(cfg.to_dict(), indent=1))


def read_head_config(path: Path) -> HeadConfig:
    cfg_path = path / CONFIG
    if not (cfg_path.exists() and (path / WEIGHTS).exists()):
        raise IncompatibleHeadError(f"{path} is not a saved head (expected {CONFIG} and {WEIGHTS})")
    return HeadConfig.from_dict(json.loads(cfg_path.read_text()))


def load_head(path: str | Path, target: Transformer, kind: str | None = None,
              dtype: torch.dtype | None = None) -> DraftHead:
    """Load a head for this target (refused, with both fingerprints named, if trained for another). `path`: a
    directory of ours, a public EAGLE / EAGLE-3 / Medusa checkpoint (heads/public.py), or a Hugging Face id."""
    from specdecode.heads.public import is_public_head_dir, load_public_head

    path = resolve_head_path(path)
    if is_public_head_dir(path):
        return load_public_head(path, target, kind, dtype)
    cfg = read_head_config(path)
    if kind is not None and cfg.kind != kind:
        raise IncompatibleHeadError(f"{path} holds a {cfg.kind} head, not a {kind} head")
    head = build_head(cfg)
    missing, unexpected = head.load_state_dict(load_file(str(path / WEIGHTS)), strict=False)
    if set(missing) - {"lm_head.weight"} or unexpected:
        raise IncompatibleHeadError(f"{path}: weights do not match the config (missing {missing}, "
                                    f"unexpected {unexpected})")
    head.to(device=target.device, dtype=dtype or target.dtype)
    head.d2t = head.d2t.long()
    head.attach(target)
    return head.eval().requires_grad_(False)


def resolve_head_path(name: str | Path) -> Path:
    """A head directory, or the cached snapshot of a Hugging Face id (ORG/NAME[@REVISION])."""
    path = Path(name).expanduser()
    if not path.exists():
        from specdecode.hub import HEAD_FILES, is_hub_id, resolve_hub

        if is_hub_id(str(name)):
            return resolve_hub(str(name), HEAD_FILES)
    return path


def head_kind(name: str | Path) -> str:
    """"eagle" or "medusa" for a head directory of ours, a public checkpoint or a Hugging Face id (`--head`)."""
    from specdecode.heads.public import is_public_head_dir

    path = resolve_head_path(name)
    if not is_public_head_dir(path):
        return read_head_config(path).kind
    hf = json.loads((path / CONFIG).read_text()) if (path / CONFIG).exists() else {}
    medusa = "medusa_num_heads" in hf or any(path.glob("medusa_lm_head*"))
    return "medusa" if medusa else "eagle"


def new_head(target: Transformer, kind: str, d2t: torch.Tensor, intermediate_size: int | None = None,
             num_medusa_heads: int = 4, seed: int = 0, feature_layers: list[int] | None = None) -> DraftHead:
    """A freshly initialised fp32 head for this target over the draft vocabulary d2t [Vd] (sorted ids);
    feature_layers: an EAGLE head fusing those layers of the target (HeadConfig.feature_layers)."""
    from specdecode.heads.config import eagle_config, medusa_config
    from specdecode.heads.fingerprint import target_fingerprint

    fp = target_fingerprint(target)
    if kind == "eagle":
        cfg = eagle_config(target.config, fp, len(d2t), intermediate_size, feature_layers)
    elif kind == "medusa":
        cfg = medusa_config(target.config, fp, len(d2t), num_medusa_heads)
    else:
        raise ValueError(f"unknown head kind {kind!r}; expected eagle or medusa")
    torch.manual_seed(seed)
    head = build_head(cfg)
    head.d2t = d2t.long().clone()
    head.to(device=target.device)
    return head.attach(target)
