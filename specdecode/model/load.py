"""Turn a model name (alias, .gguf file or HF directory) into our Transformer + Tokenizer.

GGUF dequantization takes tens of seconds for the 1.5B model, so the first load writes a
converted copy (safetensors in the requested dtype + tokenizer files) under
`<SPECDECODE_HOME>/converted/`; later loads memory-map it and take seconds.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specdecode.fetch import models_home, resolve_model
from specdecode.log import progress_bar, timed_step
from specdecode.model.architectures import config_from_hf, hf_state_dict
from specdecode.model.config import ModelConfig, UnsupportedModelError
from specdecode.model.gguf_loader import (
    CorruptModelError,
    config_from_gguf_file,
    iter_state_dict,
    open_gguf,
    with_rope_freqs,
)
from specdecode.model.gguf_types import check_gguf_tensors, check_state_shapes
from specdecode.model.tokenizer import Tokenizer
from specdecode.model.transformer import Transformer

logger = logging.getLogger(__name__)

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
          "fp16": torch.float16, "float16": torch.float16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of bf16, fp32, fp16")
    return DTYPES[dtype]


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: Tokenizer
    config: ModelConfig
    path: Path
    name: str


def _dtype_tag(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _build(cfg: ModelConfig, tensors: dict[str, torch.Tensor], device: torch.device) -> Transformer:
    with torch.device("meta"):
        model = Transformer(cfg)
    missing, unexpected = model.load_state_dict(hf_state_dict(cfg, tensors), strict=False, assign=True)
    allowed_missing = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    if set(missing) - allowed_missing or unexpected:
        raise CorruptModelError(f"weights do not match the architecture: missing {missing}, unexpected {unexpected}")
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.fuse_projections().to(device).eval()


def _read_safetensors(files: list[Path], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for key in sf.keys():
                out[key] = sf.get_tensor(key).to(dtype)
    return out


def _converted_dir(gguf_path: Path) -> Path:
    st = gguf_path.stat()
    return models_home() / "converted" / f"{gguf_path.stem}-{st.st_size}-{int(st.st_mtime)}"


def _convert_gguf(gguf_path: Path, dtype: torch.dtype, out_dir: Path) -> None:
    """Dequantize once and store config, weights and tokenizer under out_dir (atomically)."""
    cfg = config_from_gguf_file(gguf_path)  # the header first: a damaged or unsupported file fails in ms
    check_gguf_tensors(gguf_path)  # tensor types, and the tensor table against the file's size
    reader = open_gguf(gguf_path)
    cfg = with_rope_freqs(cfg, reader)  # Llama 3.x RoPE scaling lives in a tensor
    with progress_bar(total=len(reader.tensors), desc=f"converting {gguf_path.name}", unit="tensor") as bar:
        tensors = dict(iter_state_dict(reader, cfg, dtype, on_tensor=lambda _: bar.update(1)))
    check_state_shapes(gguf_path, cfg, tensors)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=".tmp-"))
    try:
        if not (out_dir / "tokenizer_config.json").exists():
            Tokenizer.from_gguf(gguf_path).save(tmp)
        if not (out_dir / "specdecode_config.json").exists():
            (tmp / "specdecode_config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=1))
        save_file(tensors, str(tmp / f"model-{_dtype_tag(dtype)}.safetensors"))
        out_dir.mkdir(exist_ok=True)
        for f in tmp.iterdir():
            f.replace(out_dir / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def converted_gguf(path: Path, dtype: torch.dtype) -> tuple[Path, Path]:
    """(converted dir, weights file) for a GGUF in `dtype`, converting it on first use."""
    conv = _converted_dir(path)
    weights = conv / f"model-{_dtype_tag(dtype)}.safetensors"
    if _stale_conversion(path, conv / "specdecode_config.json"):
        shutil.rmtree(conv, ignore_errors=True)
    if not weights.exists():
        logger.info("converting %s to %s on first use (dequantizing every tensor once)", path.name, _dtype_tag(dtype))
        try:
            with timed_step(logger, f"converted {path.name} to {_dtype_tag(dtype)} (once; cached in {conv})",
                            always=True):
                _convert_gguf(path, dtype, conv)
        except CorruptModelError:
            _forget_cached(path)
            raise
    return conv, weights


def _stale_conversion(path: Path, cfg_file: Path) -> bool:
    """Whether a converted copy's config says less than the GGUF's header (a copy written before the runtime
    read e.g. rope_freqs or sliding windows would load another model): then it is converted again."""
    if not cfg_file.exists():
        return False
    try:
        stored = ModelConfig(**json.loads(cfg_file.read_text()))
    except (TypeError, ValueError):
        return True
    header = config_from_gguf_file(path)  # the header only: milliseconds
    if stored.rope_type == "freq_factors" and stored.rope_freq_factors is None:
        return True
    return dataclasses.replace(stored, rope_freq_factors=None) != header


def _load_gguf(path: Path, dtype: torch.dtype, device: torch.device) -> tuple[Transformer, ModelConfig]:
    conv, weights = converted_gguf(path, dtype)
    cfg = ModelConfig(**json.loads((conv / "specdecode_config.json").read_text()))
    return _build(cfg, _read_safetensors([weights], dtype), device), cfg


def _forget_cached(path: Path) -> None:
    """A damaged file inside our cache is removed so the next run fetches it again."""
    home = models_home().resolve()
    if home in path.resolve().parents:
        path.unlink(missing_ok=True)
        path.with_name(path.name + ".sha256").unlink(missing_ok=True)


def _load_hf_dir(path: Path, dtype: torch.dtype, device: torch.device) -> tuple[Transformer, ModelConfig]:
    cfg = config_from_hf(json.loads((path / "config.json").read_text()))
    files = sorted(path.glob("*.safetensors"))
    return _build(cfg, _read_safetensors(files, dtype), device), cfg


def load_model(
    name: str | Path, dtype: str | torch.dtype = "bf16", device: str | torch.device | None = None
) -> LoadedModel:
    """Resolve (fetching a missing alias), load weights and tokenizer."""
    path = resolve_model(str(name))
    torch_dtype = parse_dtype(dtype)
    dev = torch.device(device) if device is not None else default_device()
    return load_resolved(path, str(name), torch_dtype, dev)


def read_config(path: Path) -> ModelConfig:
    """The architecture of a resolved model path, without loading weights (for memory checks)."""
    if path.is_dir():
        return config_from_hf(json.loads((path / "config.json").read_text()))
    conv = _converted_dir(path) / "specdecode_config.json"
    try:
        if conv.exists() and not _stale_conversion(path, conv):
            return ModelConfig(**json.loads(conv.read_text()))
        return config_from_gguf_file(path)  # the header only: no weights, no vocabulary
    except CorruptModelError:
        _forget_cached(path)
        raise


def resolve_quantization(requested: str, path: Path, dtype: torch.dtype, device: torch.device) -> str:
    """The target's weight format. "auto": a .gguf file in bf16 on a CPU with the GGUF kernels runs on its own
    quantized blocks ("gguf": llama.cpp's model, in about the file's memory, faster than the dequantized one);
    fp32 (the dtype of exact comparisons), other devices and model directories keep the model's weights as
    they are, dequantized for a GGUF ("none"). Any other value is the user's choice and is kept."""
    if requested != "auto":
        return requested
    from specdecode.model import gguf_linear

    native = (path.suffix == ".gguf" and device.type == "cpu" and dtype == torch.bfloat16
              and gguf_linear.available())
    return "gguf" if native else "none"


def resolve_draft_quantization(requested: str, path: Path, dtype: torch.dtype, device: torch.device) -> str:
    """A draft model's weight format. "auto": a .gguf draft runs on its own blocks wherever a target would
    ("gguf": in about the file's memory, with a catch-up over the prompt about three times faster than
    int4-hybrid's bf16 prefill on AVX512-BF16; on AMX int4-hybrid is as fast within noise but holds a bf16 copy
    too); otherwise "auto" stays for `draft_linear_format` (the CPU's fastest single-token path). Any other value
    is the user's choice."""
    if requested == "auto" and resolve_quantization("auto", path, dtype, device) == "gguf":
        return "gguf"
    return requested


def load_resolved(path: Path, name: str, dtype: torch.dtype, device: torch.device,
                  quantization: str = "none", tokenizer: Tokenizer | None = None) -> LoadedModel:
    """quantization "gguf": a GGUF's quantized blocks kept as they are (`gguf_model`), not dequantized.
    `tokenizer`: the model's, where the caller has loaded it already (else `load_tokenizer`)."""
    with timed_step(logger, f"loaded {name} ({_dtype_tag(dtype)}, {device})"):
        if quantization == "gguf":
            if path.is_dir() or device.type != "cpu":
                raise ValueError("quantization 'gguf' needs a .gguf model on the CPU")
            from specdecode.model.gguf_model import load_native

            model, cfg = load_native(path, dtype)
        elif path.is_dir():
            model, cfg = _load_hf_dir(path, dtype, device)
        else:
            model, cfg = _load_gguf(path, dtype, device)
        tok = tokenizer if tokenizer is not None else load_tokenizer(path)
    return LoadedModel(model=model, tokenizer=tok, config=cfg, path=path, name=name)


def load_tokenizer(path: Path) -> Tokenizer:
    """The tokenizer of a resolved model path, without loading or converting weights."""
    if path.is_dir():
        return Tokenizer.from_dir(path)
    conv = _converted_dir(path)
    if (conv / "tokenizer_config.json").exists():
        return Tokenizer.from_dir(conv)
    tok = Tokenizer.from_gguf(path)  # parsing a large vocabulary out of the GGUF takes seconds: kept for next time
    _keep_tokenizer(tok, conv)
    return tok


def _keep_tokenizer(tok: Tokenizer, conv: Path) -> None:
    """Save the tokenizer into the model's converted directory (atomically, file by file); a cache that cannot be
    written costs the next load the parse again, never this one."""
    try:
        conv.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=conv.parent, prefix=".tmp-"))
        try:
            tok.save(tmp)
            conv.mkdir(exist_ok=True)
            for f in sorted(tmp.iterdir(), key=lambda f: f.name == "tokenizer_config.json"):  # the marker last
                f.replace(conv / f.name)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as exc:
        logger.warning("cannot keep the tokenizer in %s (%s): the next load parses the GGUF again", conv, exc)


_PLAIN_FIELDS = {f.name: f.default for f in dataclasses.fields(ModelConfig) if f.default is not dataclasses.MISSING}


def hf_checkpoint_dir(path: Path, dtype: torch.dtype) -> Path:
    """Our dequantized copy of a GGUF laid out as a Hugging Face checkpoint (config.json, safetensors,
    tokenizer), so a reference implementation runs on exactly the weights our runtime runs on."""
    if path.is_dir():
        return path
    conv, weights = converted_gguf(path, dtype)
    cfg = ModelConfig(**json.loads((conv / "specdecode_config.json").read_text()))
    if cfg != ModelConfig(**{**dataclasses.asdict(cfg), **_PLAIN_FIELDS, "arch": cfg.arch}) or cfg.arch not in (
            "llama", "qwen2"):
        # This writer maps plain Llama/Qwen2 configs only: anything else would make the reference compute
        # another model.
        raise UnsupportedModelError(f"a Hugging Face reference copy of a {cfg.arch} GGUF with {cfg} is not supported")
    out = conv / f"hf-{_dtype_tag(dtype)}"
    out.mkdir(exist_ok=True)
    hf_cfg = {
        "model_type": cfg.arch, "architectures": ["Qwen2ForCausalLM" if cfg.arch == "qwen2" else "LlamaForCausalLM"],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_norm_eps, "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings, "torch_dtype": _dtype_tag(dtype), "hidden_act": "silu",
    }
    if cfg.arch == "llama":
        hf_cfg["attention_bias"] = cfg.attention_bias
    (out / "config.json").write_text(json.dumps(hf_cfg, indent=1))
    link = out / "model.safetensors"
    if not link.exists():
        link.symlink_to(weights)
    tokenizer_files = ("special_tokens_map.json", "chat_template.jinja")
    for f in conv.iterdir():
        if f.is_file() and (f.name.startswith("tokenizer") or f.name in tokenizer_files):
            target = out / f.name
            if not target.exists():
                target.symlink_to(f)
    return out
