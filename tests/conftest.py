"""Shared fixtures: tiny random Llama/Qwen2 checkpoints in Hugging Face format, and real-model helpers.

The tiny models have peaked logits (large init) so that fp32 greedy decoding has no near-ties
that could flip between a k-token and a 1-token forward.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

TINY_VOCAB_CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "for i in range(10):\n    print(i * i)\n",
    "Speculative decoding drafts tokens and verifies them in one pass.",
    "import numpy as np\nx = np.zeros(3)\n",
]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _save_tokenizer(path: Path, vocab_size: int) -> int:
    """Train a byte-level BPE on a fixed corpus (deterministic) and save it as a HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TINY_VOCAB_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return len(fast)


def make_tiny_hf_dir(path: Path, arch: str = "llama", seed: int = 0, tie: bool = False,
                     save_tokenizer: Callable[[Path], int] | None = None) -> Path:
    """A random tiny model + tokenizer (the byte-level BPE of 320 ids, or what `save_tokenizer` saves, returning
    its size), saved like a Hugging Face checkpoint directory."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    path.mkdir(parents=True, exist_ok=True)
    vocab = save_tokenizer(path) if save_tokenizer is not None else _save_tokenizer(path, 320)
    common = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=tie,
        initializer_range=0.25, eos_token_id=2, bos_token_id=0, pad_token_id=0,
    )
    cfg = LlamaConfig(rope_theta=10000.0, **common) if arch == "llama" else Qwen2Config(rope_theta=100000.0, **common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    if arch == "qwen2":  # HF initialises biases to zero; make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    model.save_pretrained(str(path), safe_serialization=True)
    cfg_json = json.loads((path / "config.json").read_text())
    assert cfg_json["model_type"] == arch
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_dir(tmp_path_factory.mktemp("tiny_llama"), "llama", seed=0)


@pytest.fixture(scope="session")
def tiny_llama_other_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same tokenizer, different random weights: a useless drafter for tiny_llama_dir."""
    return make_tiny_hf_dir(tmp_path_factory.mktemp("tiny_llama_other"), "llama", seed=1)


@pytest.fixture(scope="session")
def tiny_tied_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Output rows = input embeddings, as in Qwen2.5 and SmolLM2."""
    return make_tiny_hf_dir(tmp_path_factory.mktemp("tiny_tied"), "llama", seed=4, tie=True)


@pytest.fixture(scope="session")
def tiny_qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_dir(tmp_path_factory.mktemp("tiny_qwen"), "qwen2", seed=2)


@pytest.fixture(scope="session")
def tiny_sentencepiece_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Llama over a SentencePiece-style vocabulary: a draft with another tokenizer than the
    others' (tests/vocab_helpers.py)."""
    from vocab_helpers import sentencepiece_tiny_dir

    return sentencepiece_tiny_dir(tmp_path_factory.mktemp("tiny_sentencepiece"))


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # Unit tests use small tensors: on a shared 2-core machine a second OpenMP thread only adds barrier
    # stalls (measured 5-10x slower forwards under load). Restored afterwards. The CLI's `--threads` default too.
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setattr("specdecode.cli_args.default_threads", lambda: 1)
    yield
    torch.set_num_threads(prev)


@pytest.fixture(autouse=True, scope="session")
def _no_cost_cache() -> Iterator[None]:
    # Every test (and every model a fixture loads) measures its own costs and writes nothing to the user's cache
    # (engine/cost_cache.py); the cost cache's own tests turn it on over a private SPECDECODE_HOME.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDECODE_COST_CACHE", "0")
        yield


@pytest.fixture(scope="module")
def plain_tiny(tiny_llama_dir: Path):  # noqa: ANN201 - (LLM, plain greedy outputs of tiny_prompts)
    """Plain fp32 decoding of the tiny Llama on the shared prompts: the reference for exactness tests."""
    from tiny_helpers import GREEDY, tiny_prompts

    from specdecode import LLM

    llm = LLM(str(tiny_llama_dir), dtype="fp32")
    return llm, [o.token_ids for o in llm.generate(tiny_prompts(llm), GREEDY)]


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty SPECDECODE_HOME (models_home() reads the variable at call time)."""
    h = tmp_path / "home"
    (h / "models").mkdir(parents=True)
    monkeypatch.setenv("SPECDECODE_HOME", str(h))
    return h


@pytest.fixture(scope="session")
def tiny_heads(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Random EAGLE and Medusa heads for the tiny llama (draft vocabulary: every other token)."""
    from specdecode.heads.persist import new_head, save_head
    from specdecode.model.load import load_model

    target = load_model(str(tiny_llama_dir), "fp32", "cpu").model
    out = {}
    for kind in ("eagle", "medusa"):
        out[kind] = tmp_path_factory.mktemp(f"tiny_{kind}")
        save_head(new_head(target, kind, torch.arange(0, target.config.vocab_size, 2), seed=5), out[kind])
    return out
