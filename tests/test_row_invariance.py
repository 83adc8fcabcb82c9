"""Row-independent numerics on the default CPU paths (docs/design.md, Invariants): a row's logits have the same bits
as when its tokens are decoded one at a time, alone, whatever else its forwards hold: 1-16 random other rows (their
lengths, positions and tree masks), its prefix copied from another cache as a prefix-cache hit, its prompt prefilled
whole or in chunks of any size (past the few-row paths), its last tokens verified inside a tree.

Paths: fp32 and bf16 on our kernels, the weight-only int8 and int8-dynamic formats, and GGUF blocks of every kernel
type (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K) on each GGUF kernel this CPU runs; then GGUF, bf16 and int8 as on
the CPU classes without AVX512-BF16 (forced with SPECDECODE_ISA). Then what the engine does with
the logits: grammar masks, the sampling processors and log-probabilities, row by row too."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf_helpers import add, add_tokenizer, encode, finish, llama_meta
from invariance_helpers import Row, forward, new_cache, one_at_a_time, others

from specdecode.engine.constrain import mask_logits
from specdecode.model import gguf_linear, native_kernels
from specdecode.model.fast_linear import convert_linears, target_linear_format
from specdecode.model.gguf_model import load_native
from specdecode.model.load import load_model
from specdecode.model.transformer import EXACT_ATTENTION_TOKENS, Transformer
from specdecode.sampling import SamplingParams, logits_to_probs, processed_logprobs

PROMPT = 90
assert PROMPT > EXACT_ATTENTION_TOKENS  # the prompt's forwards take the prefill shapes too
CHUNKINGS = [[PROMPT], [16] * 5 + [10], [1, 64, 25], [33, 57], [66, 24], [7] * 12 + [6]]

GGUF_LAYERS = [  # per layer: q, k, v, o, gate, up, down
    ("Q4_K", "Q6_K", "Q5_0", "Q8_0", "Q4_1", "Q4_K", "Q6_K"),
    ("Q5_K", "Q4_0", "Q8_0", "Q4_1", "Q6_K", "Q5_0", "Q4_K"),
]


def write_gguf(path: Path, tokenizer_dir: Path) -> Path:
    """A random Llama GGUF (hidden 256: K-quant rows) whose linears take every kernel type."""
    rng = np.random.default_rng(0)
    hidden, ff, heads, kv = 256, 512, 4, 2
    w = gguf.GGUFWriter(str(path), "llama")
    llama_meta(w, hidden, ff, len(GGUF_LAYERS), heads, kv)
    vocab = add_tokenizer(w, tokenizer_dir)

    def put(name: str, rows: int, cols: int, qtype: str, scale: float) -> None:
        add(w, name, encode(rng.normal(0, scale, (rows, cols)).astype(np.float32), qtype, rng)[0], qtype)

    put("token_embd.weight", vocab, hidden, "Q8_0", 1.0)
    put("output.weight", vocab, hidden, "Q6_K", 0.1)
    add(w, "output_norm.weight", np.ones(hidden, dtype=np.float32), "F32")
    hd = hidden // heads
    for i, types in enumerate(GGUF_LAYERS):
        shapes = [("attn_q", hidden, hidden), ("attn_k", kv * hd, hidden), ("attn_v", kv * hd, hidden),
                  ("attn_output", hidden, hidden), ("ffn_gate", ff, hidden), ("ffn_up", ff, hidden),
                  ("ffn_down", hidden, ff)]
        for (name, rows, cols), qtype in zip(shapes, types, strict=True):
            put(f"blk.{i}.{name}.weight", rows, cols, qtype, 0.1)
        for norm in ("attn_norm", "ffn_norm"):
            add(w, f"blk.{i}.{norm}.weight", rng.uniform(0.5, 1.5, hidden).astype(np.float32), "F32")
    finish(w)
    return path


@pytest.fixture(scope="module")
def gguf_file(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "every-type.gguf", tiny_llama_dir)


def hf_model(path: Path, dtype: str, quantization: str = "none") -> Transformer:
    """The model as `LLM` runs it: loaded, then its linears in the target's format."""
    model = load_model(str(path), dtype, "cpu").model
    return convert_linears(model, target_linear_format(quantization, model.dtype, model.device))


HF_PATHS = {  # name: (dtype, quantization, model)
    "fp32-llama": ("fp32", "none", "tiny_llama_dir"), "fp32-qwen": ("fp32", "none", "tiny_qwen_dir"),
    "bf16-llama": ("bf16", "none", "tiny_llama_dir"), "bf16-qwen": ("bf16", "none", "tiny_qwen_dir"),
    "int8-qwen": ("bf16", "int8", "tiny_qwen_dir"), "int8-dynamic-llama": ("bf16", "int8-dynamic", "tiny_llama_dir"),
}
PATHS = [*HF_PATHS, *(f"gguf-{isa}" for isa in gguf_linear.ISAS), "gguf-avx512@avx512vnni", "gguf-avx2@avx2",
         "bf16-qwen@avx512vnni", "bf16-llama@avx2", "int8-qwen@avx2", "fp32-qwen@avx2"]
"""`PATH@CLASS`: the machine run as CPU class CLASS (SPECDECODE_ISA): no AVX512-BF16 library, so the bf16 and int8
linears take the AVX2 GEMMs (bf16, int8, fp32), attention the AVX2 kernel, and the norms, rope and SiLU torch's
ops."""


@pytest.fixture(scope="module", params=PATHS)
def model(request: pytest.FixtureRequest) -> Iterator[Transformer]:
    name: str = request.param
    with pytest.MonkeyPatch.context() as mp:
        if "@" in name:
            name, cls = name.split("@")
            mp.setenv("SPECDECODE_ISA", cls)  # for the whole module's use of the model: forwards choose kernels
            if native_kernels.glue_library() is None:
                pytest.skip("no AVX2 attention kernel here")
        elif not native_kernels.available():
            pytest.skip("no AVX512-BF16 CPU or no C compiler: torch's kernels, not row-independent")
        if name.startswith("gguf-"):
            isa = name.removeprefix("gguf-")
            if gguf_linear.library(isa) is None:
                pytest.skip(f"this CPU does not run the {isa} GGUF kernel")
            mp.setenv("SPECDECODE_GGUF_ISA", isa)
            m, _ = load_native(request.getfixturevalue("gguf_file"), torch.bfloat16)
            mp.delenv("SPECDECODE_GGUF_ISA")
            assert all(lin.native and lin.kernel == isa for lin in m.modules()
                       if isinstance(lin, gguf_linear.GGUFLinear))
            yield m
            return
        dtype, quantization, directory = HF_PATHS[name]
        yield hf_model(request.getfixturevalue(directory), dtype, quantization)


def prompt(model: Transformer, seed: int) -> list[int]:
    return torch.randint(0, model.config.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_chunked_prefill_alone(model: Transformer) -> None:
    gen = torch.Generator().manual_seed(1)
    tokens = prompt(model, 0)
    want = one_at_a_time(model, tokens, gen)
    for chunks in CHUNKINGS:
        cache, at, got = new_cache(model, 1, gen), 0, []
        for n in chunks:
            got += forward(model, cache, [Row.chain(tokens[at : at + n], at)], implicit_mask=True)
            at += n
        assert torch.equal(torch.cat(got), want), chunks


@pytest.mark.parametrize("trees", [False, True])
def test_beside_random_rows(model: Transformer, trees: bool) -> None:
    """The row's prompt in chunks, each forward beside 1-16 random rows (chains or trees, any widths), the row at
    a random place in the batch."""
    gen = torch.Generator().manual_seed(2 + trees)
    tokens = prompt(model, 1)
    want = one_at_a_time(model, tokens, gen)
    for n_others, chunks in [(1, [PROMPT]), (16, [40, 50]), (3, [1, 70, 19]), (7, [20] * 4 + [10]),
                             (12, [5, 85])]:
        cache, at, got = new_cache(model, n_others + 1, gen), 0, []
        row = int(torch.randint(0, n_others + 1, (1,), generator=gen))
        for n in chunks:
            rows = others(model, n_others, gen, width=min(n + 8, 40), trees=trees)
            rows.insert(row, Row.chain(tokens[at : at + n], at))
            got.append(forward(model, cache, rows)[row])
            at += n
        assert torch.equal(torch.cat(got), want), (n_others, chunks)


def test_beside_equal_chains_without_a_mask(model: Transformer) -> None:
    """Every row a chain of the same width: the forward builds the causal mask itself (decode steps)."""
    gen = torch.Generator().manual_seed(4)
    tokens = prompt(model, 2)
    want = one_at_a_time(model, tokens, gen)
    for n_others, n in [(4, 1), (15, 3), (2, PROMPT)]:
        cache, got = new_cache(model, n_others + 1, gen), []
        for at in range(0, PROMPT, n):
            rows = [Row.chain(torch.randint(0, 50, (n,), generator=gen).tolist(), 7 * i) for i in range(n_others)]
            rows.insert(1, Row.chain(tokens[at : at + n], at))
            got.append(forward(model, cache, rows, implicit_mask=True)[1])
        assert torch.equal(torch.cat(got), want), (n_others, n)


@pytest.mark.parametrize("cached", [48, 37])
def test_after_a_prefix_cache_hit(model: Transformer, cached: int) -> None:
    """The first `cached` tokens' K/V computed in another batch's row and copied in (`write_span`, as a prefix-cache
    hit), the rest prefilled beside other rows."""
    gen = torch.Generator().manual_seed(5)
    tokens = prompt(model, 3)
    want = one_at_a_time(model, tokens, gen)
    first = new_cache(model, 3, gen)
    rows = others(model, 2, gen, width=20, trees=True)
    rows.insert(2, Row.chain(tokens[:PROMPT], 0))
    head = forward(model, first, rows)[2]
    k, v = first.read_span(2, 0, cached)
    second = new_cache(model, 5, gen)
    second.write_span(3, 0, k, v)
    rows = others(model, 4, gen, width=30, trees=True)
    rows.insert(3, Row.chain(tokens[cached:], cached))
    tail = forward(model, second, rows)[3]
    assert torch.equal(head, want)
    assert torch.equal(tail, want[cached:])


def test_verified_inside_a_tree(model: Transformer) -> None:
    """The row's last tokens as one path of a random tree beside tree rows: the path's nodes have the bits of the
    chain's, though their slots are scattered among the other branches'."""
    gen = torch.Generator().manual_seed(6)
    tokens = prompt(model, 4)
    want = one_at_a_time(model, tokens, gen)
    prefix, path = PROMPT - 6, tokens[PROMPT - 6 :]
    cache = new_cache(model, 5, gen)
    rows = others(model, 4, gen, width=30, trees=True)
    rows.insert(0, Row.chain(tokens[:prefix], 0))
    forward(model, cache, rows)
    # 20 nodes: the path at nodes 0, 3, 4, 9, 10, 17, the others random branches off them.
    on_path = [0, 3, 4, 9, 10, 17]
    parents = [-1] * 20
    for i in range(1, 20):
        parents[i] = on_path[on_path.index(i) - 1] if i in on_path else int(torch.randint(0, i, (1,), generator=gen))
    node_tokens = torch.randint(0, model.config.vocab_size, (20,), generator=gen).tolist()
    depth, sees = [0] * 20, []
    for i in range(20):
        node_tokens[i] = path[on_path.index(i)] if i in on_path else node_tokens[i]
        depth[i] = 0 if i == 0 else depth[parents[i]] + 1
        anc, at = [], i
        while at >= 0:
            anc.append(prefix + at)
            at = parents[at]
        sees.append(list(range(prefix)) + sorted(anc))
    tree = Row(node_tokens, [prefix + d for d in depth], list(range(prefix, prefix + 20)), sees)
    rows = others(model, 4, gen, width=24, trees=True)
    rows.insert(0, tree)
    got = forward(model, cache, rows)[0]
    assert torch.equal(got[on_path], want[prefix:])


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0), SamplingParams(temperature=0.7), SamplingParams(temperature=0.9, top_p=0.8),
    SamplingParams(temperature=1.3, top_k=40, top_p=0.9, min_p=0.05), SamplingParams(min_p=0.1),
    SamplingParams(temperature=0.8, repetition_penalty=1.2, presence_penalty=0.5, logit_bias={3: 2.0}),
], ids=lambda p: repr(p)[:60])
def test_masks_and_processors_are_row_by_row(params: SamplingParams) -> None:
    """A row's grammar mask, processed probabilities and log-probabilities are the same alone or among others."""
    gen = torch.Generator().manual_seed(7)
    n, vocab = 13, 3001
    logits = torch.randn(n, vocab, generator=gen) * 4
    counts = torch.randint(0, 3, (n, vocab), generator=gen) * (torch.rand(n, vocab, generator=gen) < 0.01)
    prompt_mask = torch.rand(n, vocab, generator=gen) < 0.02
    masks = [torch.rand(3, vocab, generator=gen) < 0.5, None, torch.rand(10, vocab, generator=gen) < 0.1]
    masked = mask_logits(logits, [0, 3, 3, 13], masks)
    alone = mask_logits(logits[3:], [0, 0, 10], masks[1:])
    assert torch.equal(masked[3:], alone)
    probs = logits_to_probs(masked, params, counts, prompt_mask)
    logprobs = processed_logprobs(masked, params, counts, prompt_mask)
    for i in (0, 4, 12):
        one = slice(i, i + 1)
        assert torch.equal(logits_to_probs(masked[one], params, counts[one], prompt_mask[one]), probs[one])
        assert torch.equal(processed_logprobs(masked[one], params, counts[one], prompt_mask[one]), logprobs[one])
