"""Every supported family, from a Hugging Face directory and from a GGUF written as llama.cpp's converter writes it:
fp32 logits equal transformers' (1e-4), greedy output equals transformers' greedy, speculative output (n-gram,
draft model chain and tree) equals plain; unsupported architectures and options are refused by name.

Tiny random models (tests/arch_helpers.py): 2 layers, hidden 64, a window of 16-24 positions where the family has
one, so that a 64-token prompt and 32 generated tokens run well past it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from arch_helpers import make_hf_dir, reference_model, write_gguf

from specdecode import LLM, SamplingParams
from specdecode.model import native_kernels
from specdecode.model.architectures import config_from_hf
from specdecode.model.config import ModelConfig, UnsupportedModelError
from specdecode.model.gguf_loader import config_from_gguf, config_from_gguf_file, open_gguf
from specdecode.model.load import load_model, read_config
from specdecode.model.transformer import Transformer, rope_tables

KINDS = ["llama3", "qwen3", "mistral", "phi3", "gemma2"]
FORMS = ["hf", "gguf"]
NEW_TOKENS = 32
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@dataclass
class Arch:
    kind: str
    hf_dir: Path
    gguf_path: Path
    other_dir: Path
    """Same family and tokenizer, other weights: a draft that is often wrong."""
    other_gguf: Path
    prompt64: list[int]
    prompt: list[int]
    """A repetitive prompt (n-gram lookup drafts from it) for generation."""
    ref_logits: torch.Tensor
    ref_greedy: list[int]

    def path(self, form: str) -> str:
        return str(self.hf_dir if form == "hf" else self.gguf_path)

    def other(self, form: str) -> str:
        return str(self.other_dir if form == "hf" else self.other_gguf)


@pytest.fixture(scope="module")
def _env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[Path, Path]]:
    """A private SPECDECODE_HOME (GGUF conversions land there); the dict records which directory each test GGUF
    was written from."""
    home = tmp_path_factory.mktemp("home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDECODE_HOME", str(home))
        yield {}


def _hf_greedy(model, ids: list[int], n: int) -> list[int]:  # noqa: ANN001
    """transformers' greedy continuation, each token from a full forward of everything so far."""
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids):]


@pytest.fixture(scope="module", params=KINDS)
def arch(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, _env: dict[Path, Path]) -> Arch:
    kind = request.param
    root = tmp_path_factory.mktemp(kind)
    hf_dir = make_hf_dir(root / "hf", kind, seed=0)
    other = make_hf_dir(root / "other", kind, seed=1)
    path = write_gguf(hf_dir, root / f"{kind}.gguf")
    other_gguf = write_gguf(other, root / f"{kind}-other.gguf")
    _env[path], _env[other_gguf] = hf_dir, other
    ref = reference_model(hf_dir)
    g = torch.Generator().manual_seed(5)
    prompt64 = torch.randint(3, ref.config.vocab_size, (64,), generator=g).tolist()
    with torch.no_grad():
        ref_logits = ref(torch.tensor([prompt64])).logits[0].float()
    prompt = [17, 86, 70, 16, 289, 17, 86, 70, 16, 289, 17, 86, 70, 40, 41, 42, 17, 86, 70, 16]
    return Arch(kind, hf_dir, path, other, other_gguf, prompt64, prompt, ref_logits,
                _hf_greedy(ref, prompt, NEW_TOKENS))


def _random_heads(target: Transformer, root: Path) -> dict[str, Path]:
    """Untrained EAGLE (final hidden state, and EAGLE-3 style fused layers) and Medusa heads for this target."""
    from specdecode.heads.persist import new_head, save_head

    out = {}
    ids = torch.arange(0, target.config.vocab_size, 2)
    for name, kind, layers in (("eagle", "eagle", None), ("eagle3", "eagle", [0, 1, 2]), ("medusa", "medusa", None)):
        head = new_head(target, kind, ids, seed=3, feature_layers=layers)
        save_head(head, root / name)
        out[name] = root / name
    return out


def _our_logits(model: Transformer, ids: list[int]) -> torch.Tensor:
    cache = model.new_cache(1, 256)
    tokens = torch.tensor([ids])
    hidden = model(tokens, torch.arange(len(ids)).unsqueeze(0), cache)
    return model.compute_logits(hidden[0])


@pytest.mark.parametrize("form", FORMS)
def test_logits_match_transformers(arch: Arch, form: str) -> None:
    loaded = load_model(arch.path(form), "fp32", "cpu")
    assert loaded.config.arch == ("llama" if form == "gguf" and arch.kind in ("llama3", "mistral")
                                  else {"llama3": "llama"}.get(arch.kind, arch.kind))
    ours = _our_logits(loaded.model, arch.prompt64)
    assert (ours - arch.ref_logits).abs().max().item() < 1e-4
    assert ours.argmax(-1).tolist() == arch.ref_logits.argmax(-1).tolist()


def test_longer_prompt_matches_transformers(arch: Arch) -> None:
    """80 queries: past the row-by-row attention, into SDPA (or the soft-capping path)."""
    ids = (arch.prompt64 + arch.prompt)[:80]
    ref = reference_model(arch.hf_dir)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    ours = _our_logits(load_model(arch.hf_dir, "fp32", "cpu").model, ids)
    assert (ours - want).abs().max().item() < 1e-4


@pytest.mark.parametrize("form", FORMS)
def test_greedy_and_speculative_equal_transformers(arch: Arch, form: str, tmp_path: Path) -> None:
    path = arch.path(form)
    plain = LLM(path, dtype="fp32", device="cpu", max_model_len=256)
    assert plain.generate([arch.prompt], GREEDY)[0].token_ids == arch.ref_greedy
    configs = [
        # Unigram lookup: random tiny models rarely repeat a bigram, but they repeat tokens.
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
        {"method": "draft", "model": path, "num_speculative_tokens": 4, "draft_dtype": "fp32"},
        {"method": "draft", "model": arch.other(form), "num_speculative_tokens": 3, "draft_dtype": "fp32",
         "draft_tree_width": 4},
    ]
    heads = _random_heads(plain.target.model, tmp_path)
    configs += [{"method": "eagle", "model": str(heads["eagle"]), "num_speculative_tokens": 4},
                {"method": "eagle", "model": str(heads["eagle3"]), "num_speculative_tokens": 3, "draft_tree_width": 3},
                {"method": "medusa", "model": str(heads["medusa"]), "num_speculative_tokens": 3}]
    for spec in configs:
        llm = LLM(path, dtype="fp32", device="cpu", max_model_len=256, speculative_config=spec)
        out = llm.generate([arch.prompt], GREEDY)[0]
        assert out.token_ids == arch.ref_greedy, spec
        assert out.metrics["draft_tokens"] > 0, spec
        if spec.get("model") == path:  # the model drafting for itself: everything accepted
            assert out.metrics["accepted_tokens"] == out.metrics["draft_tokens"], spec


def test_bf16_runs_close_and_speculation_stays_exact(arch: Arch) -> None:
    """The default dtype: bf16 weights on the CPU formats (native kernels where the layers are plain) stay near
    transformers' fp32 logits, and speculative output equals plain output bit for bit."""
    plain = LLM(str(arch.hf_dir), dtype="bf16", device="cpu", max_model_len=256)
    logits = _our_logits(plain.target.model, arch.prompt64)
    err = (logits - arch.ref_logits).abs().mean().item()
    assert err < 0.05 * arch.ref_logits.abs().mean().item()
    want = plain.generate([arch.prompt], GREEDY)[0].token_ids
    for spec in ({"method": "draft", "model": str(arch.hf_dir), "num_speculative_tokens": 4},
                 {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}):
        llm = LLM(str(arch.hf_dir), dtype="bf16", device="cpu", max_model_len=256, speculative_config=spec)
        assert llm.generate([arch.prompt], GREEDY)[0].token_ids == want, spec


def test_batched_rows_equal_plain(arch: Arch) -> None:
    """Continuous batching: rows of different lengths in one forward, a finished row's cache (positions
    included) moved onto another, n-gram drafts: every sequence's output equals its plain greedy output."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = LLM(str(arch.hf_dir), dtype="fp32", device="cpu", max_model_len=256, speculative_config=spec)
    prompts = [arch.prompt, arch.prompt64[:30], arch.prompt64[10:17]]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (NEW_TOKENS, 12, 28)]
    plain = LLM(str(arch.hf_dir), dtype="fp32", device="cpu", max_model_len=256)
    want = [plain.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params, strict=True)]
    engine = llm.batch_engine(max_num_seqs=2)
    seqs = [llm.new_sequence(p, sp) for p, sp in zip(prompts, params, strict=True)]
    for seq in seqs:
        engine.add(seq)
    while engine.has_work():
        engine.step()
    assert [s.token_ids[s.prompt_len :] for s in seqs] == want


def test_gemma2_query_pre_attn_scalar(tmp_path: Path) -> None:
    """Gemma 2 scales scores by query_pre_attn_scalar ** -0.5, not head_dim ** -0.5 (the 27B model's case)."""
    hf_dir = make_hf_dir(tmp_path / "hf", "gemma2", query_pre_attn_scalar=40)
    ids = list(range(3, 67))
    with torch.no_grad():
        want = reference_model(hf_dir)(torch.tensor([ids])).logits[0]
    loaded = load_model(hf_dir, "fp32", "cpu")
    assert loaded.config.query_pre_attn_scalar == 40
    assert (_our_logits(loaded.model, ids) - want).abs().max().item() < 1e-4


def test_header_config_equals_full_config(arch: Arch) -> None:
    """read_config (header only) and the reader agree; the header alone knows a rope_freqs tensor is there."""
    header, full = config_from_gguf_file(arch.gguf_path), config_from_gguf(open_gguf(arch.gguf_path))
    if arch.kind == "llama3":
        assert header.rope_type == full.rope_type == "freq_factors"
        assert header.rope_freq_factors is None and full.rope_freq_factors is not None
        with pytest.raises(UnsupportedModelError, match="rope_freqs"):
            rope_tables(header, 8, "cpu")  # never unscaled RoPE by accident
        header = ModelConfig(**{**header.__dict__, "rope_freq_factors": full.rope_freq_factors})
    assert header == full
    hf = read_config(arch.hf_dir)
    for field in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "sliding_window", "sliding_layers",
                  "qk_norm", "gemma_norms", "attn_logit_softcapping", "final_logit_softcapping", "hidden_act",
                  "query_pre_attn_scalar", "tie_word_embeddings"):
        assert getattr(hf, field) == getattr(full, field), field


# ---- Llama 3 RoPE scaling -------------------------------------------------------------------------------------


def test_llama3_gguf_without_rope_freqs_is_another_model(tmp_path: Path, _env: dict[Path, Path]) -> None:
    """The scaling lives only in rope_freqs: the same weights without it compute unscaled RoPE (what the file
    then says), clearly different from the scaled model: the tensor is what our runtime applies."""
    hf_dir = make_hf_dir(tmp_path / "hf", "llama3")
    with_freqs = write_gguf(hf_dir, tmp_path / "a.gguf")
    without = write_gguf(hf_dir, tmp_path / "b.gguf", with_rope_freqs=False)
    _env[with_freqs] = _env[without] = hf_dir
    ids = list(range(3, 67))
    with torch.no_grad():
        want = reference_model(hf_dir)(torch.tensor([ids])).logits[0]
    scaled = _our_logits(load_model(with_freqs, "fp32", "cpu").model, ids)
    unscaled = _our_logits(load_model(without, "fp32", "cpu").model, ids)
    assert (scaled - want).abs().max().item() < 1e-4
    assert (unscaled - want).abs().max().item() > 1e-2
    assert read_config(without).rope_type == "default"


def test_converted_copy_from_before_rope_freqs_is_converted_again(tmp_path: Path, _env: dict[Path, Path]) -> None:
    """A converted copy written when rope_freqs was dropped (its config says default RoPE) would load unscaled
    RoPE: the header disagrees with it, so it is converted again."""
    from specdecode.model.load import _converted_dir

    hf_dir = make_hf_dir(tmp_path / "hf", "llama3")
    path = write_gguf(hf_dir, tmp_path / "l.gguf")
    _env[path] = hf_dir
    load_model(path, "fp32", "cpu")
    cfg_file = _converted_dir(path) / "specdecode_config.json"
    old = {k: v for k, v in json.loads(cfg_file.read_text()).items() if k not in ("rope_type", "rope_freq_factors")}
    cfg_file.write_text(json.dumps(old))
    assert read_config(path).rope_type == "freq_factors"  # the stale copy is not believed
    ids = list(range(3, 67))
    with torch.no_grad():
        want = reference_model(hf_dir)(torch.tensor([ids])).logits[0]
    loaded = load_model(path, "fp32", "cpu")
    assert loaded.config.rope_freq_factors is not None
    assert (_our_logits(loaded.model, ids) - want).abs().max().item() < 1e-4
    assert json.loads(cfg_file.read_text())["rope_type"] == "freq_factors"


def test_llama3_rope_matches_transformers_frequencies() -> None:
    from arch_helpers import LLAMA3_ROPE
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from specdecode.model.rope import inv_freq

    hf = LlamaConfig(hidden_size=512, num_attention_heads=4, rope_theta=500000.0,
                     rope_scaling={**LLAMA3_ROPE, "original_max_position_embeddings": 8192})
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    cfg = config_from_hf({**hf.to_dict(), "vocab_size": 10})
    assert cfg.rope_type == "llama3"
    assert torch.equal(inv_freq(cfg, "cpu"), want)


# ---- what llama.cpp's converter leaves out ---------------------------------------------------------------------


def test_mistral_gguf_without_its_window_is_held_within_it(tmp_path: Path, _env: dict[Path, Path]) -> None:
    """llama.cpp's converter writes Mistral as `llama` without its sliding window: such a file computes Mistral
    exactly only up to the window of Mistral 7B v0.1 (4096), so its context stops there (a prompt beyond is
    refused by LLM); a llama GGUF of another name keeps its context."""
    hf_dir = make_hf_dir(tmp_path / "hf", "mistral", max_position_embeddings=8192, sliding_window=4096)
    named = write_gguf(hf_dir, tmp_path / "m.gguf", window_key=False, name="Mistral-7B-v0.1")
    other = write_gguf(hf_dir, tmp_path / "o.gguf", window_key=False, name="Some-Llama")
    with_key = write_gguf(hf_dir, tmp_path / "k.gguf", name="Mistral-7B-v0.1")
    _env[named] = _env[other] = _env[with_key] = hf_dir
    cfg = read_config(named)
    assert cfg.sliding_window is None and cfg.max_position_embeddings == 4096
    assert read_config(other).max_position_embeddings == 8192
    assert read_config(with_key).sliding_window == 4096 and read_config(with_key).max_position_embeddings == 8192
    llm = LLM(str(named), dtype="fp32", device="cpu", max_model_len=6000)
    assert llm.max_model_len == 4096
    with pytest.raises(ValueError, match="4096"):
        llm.generate([[5] * 4090], SamplingParams(max_tokens=10, temperature=0.0))


def test_gemma2_gguf_keys_default_as_in_llama_cpp(tmp_path: Path) -> None:
    """Without the soft-capping and window keys llama.cpp uses Gemma 2's values (50, 30, 4096): so do we."""
    meta = {"general.architecture": "gemma2", "gemma2.block_count": 4, "gemma2.embedding_length": 64,
            "gemma2.attention.head_count": 4, "gemma2.attention.key_length": 32}
    from specdecode.model.architectures import config_kwargs_from_gguf

    out = config_kwargs_from_gguf(meta, {})
    assert (out["attn_logit_softcapping"], out["final_logit_softcapping"]) == (50.0, 30.0)
    assert out["sliding_window"] == 4096 and out["sliding_layers"] == (0, 2)
    assert out["query_pre_attn_scalar"] == 32


# ---- refusals -------------------------------------------------------------------------------------------------


def _hf_dict(kind: str, **over: object) -> dict:
    from arch_helpers import hf_config

    return {**hf_config(kind, 320).to_dict(), **over}


@pytest.mark.parametrize("model_type", ["falcon", "gpt2", "mixtral", "gemma3_text", "phimoe", ""])
def test_unsupported_hf_architecture_is_named(model_type: str) -> None:
    with pytest.raises(UnsupportedModelError, match=f"architecture '{model_type}'.*supported: .*llama.*gemma2"):
        config_from_hf(_hf_dict("mistral", model_type=model_type))


@pytest.mark.parametrize("rope_type", ["linear", "dynamic", "yarn", "longrope", "su", "ntk"])
def test_unsupported_rope_scaling_is_named(rope_type: str) -> None:
    scaling = {"rope_type": rope_type, "factor": 2.0, "rope_theta": 10000.0}
    for d in (_hf_dict("llama3", rope_scaling=scaling, rope_parameters=None),
              _hf_dict("mistral", rope_parameters=scaling), _hf_dict("phi3", rope_scaling=scaling)):
        with pytest.raises(UnsupportedModelError, match=f"rope_scaling type '{rope_type}'"):
            config_from_hf(d)


@pytest.mark.parametrize(("kind", "over", "named"), [
    ("phi3", {"partial_rotary_factor": 0.75}, "partial_rotary_factor"),
    ("phi3", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor"),
    ("qwen3", {"use_sliding_window": True}, "use_sliding_window"),
    ("qwen3", {"attention_bias": True}, "attention_bias"),
    ("mistral", {"attention_bias": True}, "attention_bias"),
    ("llama3", {"mlp_bias": True}, "mlp_bias"),
    ("llama3", {"hidden_act": "gelu"}, "hidden activation 'gelu'"),
    ("gemma2", {"hidden_activation": "gelu"}, "hidden activation 'gelu'"),
    ("gemma2", {"attention_bias": True}, "attention_bias"),
    ("gemma2", {"layer_types": ["chunked_attention", "full_attention"]}, "layer_types"),
])
def test_unsupported_option_is_named(kind: str, over: dict, named: str) -> None:
    with pytest.raises(UnsupportedModelError, match=named):
        config_from_hf(_hf_dict(kind, **over))


def _tiny_gguf(path: Path, arch: str, extra_kv: dict | None = None, extra_tensors: tuple[str, ...] = ()) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(16)
    w.add_feed_forward_length(32)
    w.add_head_count(2)
    w.add_layer_norm_rms_eps(1e-6)
    for key, value in (extra_kv or {}).items():
        if isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_uint32(key, value)
    w.add_tensor("token_embd.weight", np.zeros((8, 16), dtype=np.float32))
    w.add_tensor("blk.0.attn_q.weight", np.zeros((16, 16), dtype=np.float32))
    for name in extra_tensors:
        w.add_tensor(name, np.ones(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("arch_name", ["falcon", "gemma3", "phi2", "qwen2moe", "mistral3"])
def test_unsupported_gguf_architecture_is_named(tmp_path: Path, arch_name: str) -> None:
    p = _tiny_gguf(tmp_path / "m.gguf", arch_name)
    with pytest.raises(UnsupportedModelError, match=f"GGUF architecture '{arch_name}'.*supported: .*qwen3"):
        read_config(p)


@pytest.mark.parametrize(("kv", "tensors", "named"), [
    ({"llama.rope.scaling.type": "linear"}, (), "rope scaling 'linear'"),
    ({"llama.rope.scaling.type": "yarn"}, (), "rope scaling 'yarn'"),
    ({}, ("rope_factors_long.weight", "rope_factors_short.weight"), "LongRoPE"),
    ({"llama.rope.dimension_count": 4}, (), "partial rotary"),
    ({"llama.expert_count": 8}, (), "llama.expert_count"),
    ({"llama.attention.value_length": 4}, (), "llama.attention.value_length"),
    ({"llama.logit_scale": 3}, (), "llama.logit_scale"),
    ({"llama.attention.causal": 0}, (), "llama.attention.causal"),
])
def test_unsupported_gguf_option_is_named(tmp_path: Path, kv: dict, tensors: tuple[str, ...], named: str) -> None:
    p = _tiny_gguf(tmp_path / "m.gguf", "llama", kv, tensors)
    with pytest.raises(UnsupportedModelError, match=named):
        read_config(p)


def test_gguf_tensor_outside_the_layout_is_refused(tmp_path: Path, _env: dict[Path, Path]) -> None:
    """A Qwen3-style q/k norm tensor inside a `qwen2` GGUF would change the maths: refused, not dropped."""
    hf_dir = make_hf_dir(tmp_path / "hf", "qwen3")
    p = write_gguf(hf_dir, tmp_path / "m.gguf")
    data = bytearray(p.read_bytes())
    i = data.index(b"qwen3")
    data[i : i + 5] = b"qwen2"  # general.architecture; the keys are looked up as qwen2.* then
    for key in (b"qwen3.",):
        start = 0
        while (j := data.find(key, start)) >= 0:
            data[j : j + len(key)] = b"qwen2."
            start = j + 1
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    _env[bad] = hf_dir
    with pytest.raises(UnsupportedModelError, match="attn_q_norm"):
        load_model(bad, "fp32", "cpu")


# ---- native kernels (bf16 on CPUs with AVX512-BF16) -----------------------------------------------------------


@pytest.mark.skipif(not native_kernels.available(), reason="needs the native bf16 kernels")
@pytest.mark.parametrize("kind", ["mistral", "phi3"])
def test_native_decode_applies_the_window(tmp_path: Path, kind: str) -> None:
    """bf16 single-token decodes through the native layer stack (Mistral/Phi-3 layers are plain) keep the sliding
    window: past it, each step's logits stay at bf16 distance from transformers' fp32 logits, while the same
    weights without a window are far away."""
    from specdecode.model.fast_linear import convert_linears

    hf_dir = make_hf_dir(tmp_path / "hf", kind)
    ids = torch.randint(3, 300, (72,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        want = reference_model(hf_dir)(torch.tensor([ids])).logits[0]
        cfg = json.loads((hf_dir / "config.json").read_text())
        (tmp_path / "nowin").mkdir()
        for f in hf_dir.iterdir():
            (tmp_path / "nowin" / f.name).symlink_to(f)
        (tmp_path / "nowin" / "config.json").unlink()
        (tmp_path / "nowin" / "config.json").write_text(json.dumps({**cfg, "sliding_window": None}))
        unwindowed = reference_model(tmp_path / "nowin")(torch.tensor([ids])).logits[0]
    model = load_model(hf_dir, "bf16", "cpu").model
    convert_linears(model, "bf16")
    cache = model.new_cache(1, 128)
    model(torch.tensor([ids[:8]]), torch.arange(8).unsqueeze(0), cache)
    assert model._native_stack is not None and model._native_stack[2] is not None  # the stack took the prefill
    errors, wrong = [], []
    for p in range(8, len(ids)):
        logits = model.compute_logits(model(torch.tensor([[ids[p]]]), torch.tensor([[p]]), cache))[0, 0]
        errors.append((logits - want[p]).abs().mean().item())
        wrong.append((logits - unwindowed[p]).abs().mean().item())
    past = slice(40, None)  # positions 48..71: well past the window
    assert np.mean(errors[past]) < 0.1 * np.mean(wrong[past])
    assert max(errors[past]) < 0.5 * min(wrong[past])


def test_native_stack_refuses_layers_it_does_not_compute(tmp_path: Path) -> None:
    from specdecode.model import native_stack

    for kind in ("qwen3", "gemma2"):
        cfg = config_from_hf(json.loads((make_hf_dir(tmp_path / kind, kind) / "config.json").read_text()))
        assert not cfg.plain_layers
        with torch.device("meta"):
            model = Transformer(cfg)
        assert native_stack.build(model) is None
