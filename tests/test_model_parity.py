"""Reference parity: our decoder against Hugging Face transformers on the same weights.

Tiny random Llama / Qwen2 checkpoints (untied and tied output matrix) must give the same fp32
logits after a prefill, after each cached single-token decode step and after a cached multi-token
chunk; the real SmolLM2-135M GGUF must give transformers' exact greedy continuation.
"""

from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_hf_dir
from safetensors.torch import save_model
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from specdecode.model.load import LoadedModel, load_model

ATOL = 1e-4  # fp32, tiny models: measured differences are ~1e-6 or exactly 0



@pytest.fixture(scope="module")
def tied_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_dir(tmp_path_factory.mktemp("tied_llama"), "llama", seed=5, tie=True)


@pytest.fixture(scope="module")
def tied_qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_dir(tmp_path_factory.mktemp("tied_qwen"), "qwen2", seed=6, tie=True)


def _ours_step(lm: LoadedModel, cache, tokens: list[int], start: int) -> torch.Tensor:
    """Forward `tokens` at positions start.. and return fp32 logits [T, V]; then advance the length."""
    toks = torch.tensor([tokens])
    pos = torch.arange(start, start + len(tokens)).unsqueeze(0)
    logits = lm.model.compute_logits(lm.model(toks, pos, cache))[0]
    cache.set_length(0, start + len(tokens))
    return logits


def _ref_step(ref, cache: DynamicCache, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        out = ref(torch.tensor([tokens]), cache=cache, use_cache=True)
    return out.logits[0].float()


@pytest.mark.parametrize(
    ("dir_fixture", "arch", "tied"),
    [
        ("tiny_llama_dir", "llama", False),
        ("tiny_qwen_dir", "qwen2", False),
        ("tied_llama_dir", "llama", True),
        ("tied_qwen_dir", "qwen2", True),
    ],
)
def test_tiny_logit_parity(request: pytest.FixtureRequest, dir_fixture: str, arch: str, tied: bool) -> None:
    path: Path = request.getfixturevalue(dir_fixture)
    lm = load_model(str(path), "fp32", "cpu")
    ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()

    # The variant is what it claims to be, on both sides.
    assert lm.config.arch == arch and lm.config.tie_word_embeddings == tied
    assert ref.config.model_type == arch and bool(ref.config.tie_word_embeddings) == tied
    assert (lm.model.lm_head.weight is lm.model.model.embed_tokens.weight) == tied
    assert lm.config.attention_bias == (arch == "qwen2")

    gen = torch.Generator().manual_seed(1234)
    prompt = torch.randint(0, lm.config.vocab_size, (13,), generator=gen).tolist()
    cache = lm.model.new_cache(1, 256)
    ref_cache = DynamicCache(config=ref.config)

    # Prefill: every position, not only the last.
    ours = _ours_step(lm, cache, prompt, 0)
    theirs = _ref_step(ref, ref_cache, prompt)
    assert ours.shape == theirs.shape == (len(prompt), lm.config.vocab_size)
    assert (ours - theirs).abs().max().item() < ATOL
    assert ours.abs().max().item() > 1.0  # not a degenerate all-zero comparison

    # 8 cached single-token decode steps, feeding the greedy token.
    n = len(prompt)
    tok = int(theirs[-1].argmax())
    for step in range(8):
        ours = _ours_step(lm, cache, [tok], n)
        theirs = _ref_step(ref, ref_cache, [tok])
        diff = (ours[-1] - theirs[-1]).abs().max().item()
        assert diff < ATOL, f"decode step {step}: max |diff| {diff}"
        n += 1
        tok = int(theirs[-1].argmax())

    # A cached multi-token chunk (what a verify pass does).
    chunk = [tok, *torch.randint(0, lm.config.vocab_size, (4,), generator=gen).tolist()]
    ours = _ours_step(lm, cache, chunk, n)
    theirs = _ref_step(ref, ref_cache, chunk)
    assert (ours - theirs).abs().max().item() < ATOL


# ---- real weights: SmolLM2-135M-Instruct (GGUF Q4_1, dequantized to fp32 on both sides) -------------

SMOLLM = "smollm2-135m-instruct"
CHAT = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
]


@pytest.fixture(scope="module")
def smollm_path() -> Path:
    from specdecode.fetch import resolve_model

    return resolve_model(SMOLLM)


@pytest.fixture(scope="module")
def hf_smollm(smollm_path: Path, pytestconfig: pytest.Config):
    """transformers' own GGUF loader (its dequantization, its Llama): the reference.

    transformers reads this GGUF slowly (~25 s on the shared CI cores), so the dequantized
    reference is kept in pytest's cache directory, keyed by the file and the transformers version;
    the tokenizer is always built from the GGUF afresh (it is what the chat-template test checks).
    """
    import transformers

    torch.set_num_threads(1)
    st = smollm_path.stat()
    key = f"{smollm_path.stem}-{st.st_size}-{int(st.st_mtime)}-transformers{transformers.__version__}"
    cache = getattr(pytestconfig, "cache", None)
    saved = cache.mkdir("hf-reference") / key if cache is not None else None
    if saved is not None and (saved / "config.json").is_file():
        model = AutoModelForCausalLM.from_pretrained(str(saved), dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            str(smollm_path.parent), gguf_file=smollm_path.name, dtype=torch.float32
        )
        if saved is not None:  # write-then-rename: a concurrent run never sees half a checkpoint
            tmp = saved.with_name(f".{key}.{os.getpid()}")
            tmp.mkdir(parents=True, exist_ok=True)
            cfg = copy.deepcopy(model.config)
            del cfg.quantization_config  # the GGUF-loaded model refuses save_pretrained; its weights are plain
            cfg.save_pretrained(str(tmp))
            save_model(model, str(tmp / "model.safetensors"))
            try:
                tmp.rename(saved)
            except OSError:  # another run got there first
                shutil.rmtree(tmp, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(str(smollm_path.parent), gguf_file=smollm_path.name)
    return model.eval(), tok


@pytest.fixture(scope="module")
def our_smollm():
    import specdecode

    torch.set_num_threads(1)
    return specdecode.LLM(SMOLLM, dtype="fp32", device="cpu", max_model_len=256)


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Plain greedy with no EOS handling (our ignore_eos=True); HF's generate would suppress EOS under
    min_new_tokens, so a hand loop is the faithful reference."""
    cache = DynamicCache(config=model.config)
    out: list[int] = []
    ids = prompt
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids]), cache=cache, use_cache=True).logits[0, -1]
            ids = [int(logits.argmax())]
            out.append(ids[0])
    return out


@pytest.mark.real
def test_smollm_chat_template_matches_transformers(our_smollm, hf_smollm) -> None:
    _, hf_tok = hf_smollm
    ours = our_smollm.tokenizer.apply_chat_template(CHAT)
    enc = hf_tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    theirs = list(enc["input_ids"] if hasattr(enc, "keys") else enc)
    assert ours == theirs
    text = hf_tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n") and "And of Italy?" in text
    assert our_smollm.tokenizer.decode(ours, skip_special_tokens=False) == text


@pytest.mark.real
def test_smollm_prefill_logits_close_to_transformers(our_smollm, hf_smollm) -> None:
    hf_model, _ = hf_smollm
    prompt = our_smollm.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    model = our_smollm.target.model
    cache = model.new_cache(1, 64)
    ours = model.compute_logits(model(torch.tensor([prompt]), torch.arange(len(prompt)).unsqueeze(0), cache))[0]
    with torch.no_grad():
        theirs = hf_model(torch.tensor([prompt])).logits[0].float()
    # Same dequantized weights, 30 fp32 layers: only summation-order differences remain.
    assert (ours - theirs).abs().max().item() < 1e-3
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


@pytest.mark.real
def test_smollm_greedy_matches_transformers(our_smollm, hf_smollm) -> None:
    from specdecode import SamplingParams

    hf_model, _ = hf_smollm
    tok = our_smollm.tokenizer
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": "Write a haiku about the sea."}]),
        tok.encode("def fibonacci(n):"),
        tok.encode("The history of Rome begins"),
    ]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    outputs = our_smollm.generate(prompts, params)
    for prompt, out in zip(prompts, outputs, strict=True):
        ours = list(out.outputs[0].token_ids)
        assert len(ours) == 32
        assert ours == _hf_greedy(hf_model, prompt, 32), tok.decode(prompt)
