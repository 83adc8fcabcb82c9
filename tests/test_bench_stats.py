"""Benchmark statistics on hand-made records (no model)."""

from __future__ import annotations

import math

import pytest

from specdecode.bench import stats
from specdecode.bench.bandwidth import memory_floor, weight_bytes_per_token
from specdecode.bench.datasets import load_prompts
from specdecode.bench.methods import parse_method


def rec(method, task, i, out, seconds, steps=None, drafted=None, accepted=None, acc_pos=None, dr_pos=None,
        ids=None):
    return {
        "method": method, "task": task, "prompt_index": i, "output_tokens": out, "seconds": seconds,
        "tokens_per_second": out / seconds, "steps": steps, "draft_tokens": drafted, "accepted_tokens": accepted,
        "accepted_by_position": acc_pos, "drafted_by_position": dr_pos, "draft_seconds": None,
        "verify_seconds": None, "token_ids": ids if ids is not None else list(range(out)),
    }


def test_speedup_is_ratio_of_means_not_mean_of_ratios():
    plain = [rec("plain", "t", 0, 10, 1.0), rec("plain", "t", 1, 10, 10.0)]  # 10 and 1 tok/s
    fast = [rec("m", "t", 0, 20, 1.0), rec("m", "t", 1, 10, 5.0)]  # 20 and 2 tok/s
    assert stats.mean_tokens_per_second(plain) == pytest.approx(5.5)
    assert stats.mean_tokens_per_second(fast) == pytest.approx(11.0)
    assert stats.speedup(fast, plain) == pytest.approx(11.0 / 5.5)  # 2.0
    # the mean of per-prompt ratios would be (2 + 2) / 2 = 2.0 too; make them differ:
    fast2 = [rec("m", "t", 0, 30, 1.0), rec("m", "t", 1, 10, 10.0)]  # 30 and 1 tok/s: ratios 3 and 1
    assert stats.speedup(fast2, plain) == pytest.approx(15.5 / 5.5)
    assert stats.speedup(fast2, plain) != pytest.approx(2.0)
    assert stats.speedup([], plain) is None
    assert stats.speedup(fast, []) is None


def test_tau_is_sum_output_over_sum_steps():
    rs = [rec("m", "t", 0, 10, 1.0, steps=4), rec("m", "t", 1, 2, 1.0, steps=2)]
    assert stats.mean_accepted_length(rs) == pytest.approx(12 / 6)  # not mean(2.5, 1.0) = 1.75
    assert stats.mean_accepted_length([rec("hf", "t", 0, 5, 1.0)]) is None  # steps unknown
    assert stats.mean_accepted_length([rec("m", "t", 0, 0, 1.0, steps=0)]) is None


def test_acceptance_rate_is_sum_accepted_over_sum_drafted():
    rs = [rec("m", "t", 0, 10, 1.0, drafted=10, accepted=9), rec("m", "t", 1, 2, 1.0, drafted=30, accepted=3)]
    assert stats.acceptance_rate(rs) == pytest.approx(12 / 40)
    assert stats.acceptance_rate([rec("m", "t", 0, 3, 1.0, drafted=0, accepted=0)]) is None
    assert stats.acceptance_rate([rec("hf", "t", 0, 3, 1.0)]) is None
    mixed = [rs[0], rec("hf", "t", 1, 3, 1.0)]  # one unknown makes the sum unknown
    assert stats.acceptance_rate(mixed) is None


def test_acceptance_by_position_sums_counts():
    rs = [
        rec("m", "t", 0, 5, 1.0, acc_pos=[4, 2], dr_pos=[4, 4]),
        rec("m", "t", 1, 5, 1.0, acc_pos=[1, 0, 0], dr_pos=[4, 2, 1]),
    ]
    assert stats.position_counts(rs) == ([5, 2, 0], [8, 6, 1])
    assert stats.acceptance_by_position(rs) == pytest.approx([5 / 8, 2 / 6, 0.0])
    assert stats.acceptance_by_position([rec("m", "t", 0, 5, 1.0, acc_pos=[], dr_pos=[])]) == []
    assert stats.acceptance_by_position([rec("hf", "t", 0, 5, 1.0)]) is None


def test_identical_rate_matches_prompts_by_task_and_index():
    plain = [rec("plain", "a", 0, 3, 1.0, ids=[1, 2, 3]), rec("plain", "a", 1, 3, 1.0, ids=[4, 5, 6]),
             rec("plain", "b", 0, 2, 1.0, ids=[7, 8])]
    other = [rec("m", "b", 0, 2, 1.0, ids=[7, 8]), rec("m", "a", 1, 3, 1.0, ids=[4, 5, 9]),
             rec("m", "a", 0, 3, 1.0, ids=[1, 2, 3]), rec("m", "c", 0, 1, 1.0, ids=[1])]
    assert stats.identical_rate(other, plain) == pytest.approx(2 / 3)  # task c has no baseline: left out
    assert stats.identical_rate(plain, plain) == 1.0
    assert stats.identical_rate([rec("m", "z", 0, 1, 1.0)], plain) is None


def test_summarize_per_task_and_overall():
    plain = [rec("plain", "a", 0, 10, 1.0, steps=10, drafted=0, accepted=0, acc_pos=[], dr_pos=[], ids=[1]),
             rec("plain", "b", 0, 10, 2.0, steps=10, drafted=0, accepted=0, acc_pos=[], dr_pos=[], ids=[2])]
    spec = [rec("draft", "a", 0, 10, 0.5, steps=4, drafted=12, accepted=6, acc_pos=[3, 2, 1], dr_pos=[4, 4, 4],
                ids=[1]),
            rec("draft", "b", 0, 10, 2.0, steps=10, drafted=10, accepted=0, acc_pos=[0], dr_pos=[10], ids=[3])]
    hf = [rec("hf-plain", "a", 0, 10, 0.5, ids=[1]), rec("hf-plain", "b", 0, 10, 0.5, ids=[2]),
          rec("hf-assisted", "a", 0, 10, 0.25, ids=[1]), rec("hf-assisted", "b", 0, 10, 1.0, ids=[9])]
    s = stats.summarize(plain + spec + hf, "plain", {"hf-assisted": "hf-plain"})
    assert s["methods"] == ["plain", "draft", "hf-plain", "hf-assisted"]
    assert s["tasks"] == ["a", "b"]
    d = s["by_method"]["draft"]
    assert d["overall"]["tokens_per_second"] == pytest.approx((20 + 5) / 2)
    assert d["overall"]["speedup"] == pytest.approx(12.5 / 7.5)
    assert d["tasks"]["a"]["speedup"] == pytest.approx(20 / 10)
    assert d["tasks"]["b"]["speedup"] == pytest.approx(1.0)
    assert d["overall"]["mean_accepted_length"] == pytest.approx(20 / 14)
    assert d["tasks"]["a"]["mean_accepted_length"] == pytest.approx(2.5)
    assert d["overall"]["acceptance_rate"] == pytest.approx(6 / 22)
    assert d["overall"]["acceptance_by_position"] == pytest.approx([3 / 14, 2 / 4, 1 / 4])
    assert d["overall"]["identical_rate"] == pytest.approx(0.5)
    assert d["tasks"]["a"]["identical_rate"] == 1.0
    p = s["by_method"]["plain"]["overall"]
    assert p["speedup"] == pytest.approx(1.0) and p["identical_rate"] == 1.0 and p["mean_accepted_length"] == 1.0
    a = s["by_method"]["hf-assisted"]
    assert a["overall"]["speedup_vs_own_plain"] == pytest.approx(((40 + 10) / 2) / 20)
    assert a["overall"]["identical_rate_vs_own_plain"] == pytest.approx(0.5)
    assert a["overall"]["mean_accepted_length"] is None and a["overall"]["acceptance_rate"] is None
    assert "speedup_vs_own_plain" not in s["by_method"]["draft"]["overall"]


def test_parse_method():
    assert parse_method("plain", None).speculative_config is None
    assert parse_method("ngram", None).speculative_config == {"method": "ngram", "num_speculative_tokens": "auto"}
    assert parse_method("ngram-k3", None).speculative_config["num_speculative_tokens"] == 3
    assert parse_method("draft-k4", "d").speculative_config == {"method": "draft", "num_speculative_tokens": 4,
                                                               "model": "d"}
    assert parse_method("draft-nolookup-k4", "d").speculative_config == {
        "method": "draft", "num_speculative_tokens": 4, "model": "d", "draft_prompt_lookup": False}
    assert parse_method("eagle-nolookup", None, {"eagle": "e"}).speculative_config["draft_prompt_lookup"] is False
    assert parse_method("eagle-nolookup-k3", None, {"eagle": "e"}).speculative_config == {
        "method": "eagle", "num_speculative_tokens": 3, "model": "e", "draft_prompt_lookup": False}
    assert parse_method("draft-k4~int4-hybrid", "d").speculative_config == {
        "method": "draft", "num_speculative_tokens": 4, "model": "d", "quantization": "int4-hybrid"}
    spec = parse_method("draft~int8@int8-dynamic", "d")
    assert spec.quantization == "int8-dynamic" and spec.speculative_config["quantization"] == "int8"
    assert parse_method("draft-nolookup-v0-k4", "d").speculative_config == {
        "method": "draft", "num_speculative_tokens": 4, "model": "d", "draft_prompt_lookup": False,
        "draft_vocab_size": 0}
    for bad in ("plain-k2", "medusa", "draft-k", "ngram-nolookup", "plain-nolookup", "draft-promptvocab",
                "plain~int8", "draft~int2", "eagle-v100", "ngram-v100"):
        with pytest.raises(ValueError):
            parse_method(bad, "d")
    with pytest.raises(ValueError, match="--draft"):
        parse_method("draft", None)
    heads = {"eagle": "e", "medusa": "m"}
    with pytest.raises(ValueError, match="unknown method"):
        parse_method("eagle-promptvocab", None, heads)
    assert parse_method("eagle", None, heads).speculative_config == {"method": "eagle", "model": "e",
                                                                      "num_speculative_tokens": "auto"}
    assert parse_method("eagle-chain-k5", None, heads).speculative_config == {
        "method": "eagle", "model": "e", "num_speculative_tokens": 5, "draft_tree_width": 1}
    assert parse_method("draft-tree", "d").speculative_config["draft_tree_width"] == 0
    assert parse_method("eagle-w2-nolookup-k4", None, heads).speculative_config == {
        "method": "eagle", "model": "e", "num_speculative_tokens": 4, "draft_tree_width": 2,
        "draft_prompt_lookup": False}
    assert parse_method("eagle-b4", None, heads).speculative_config == {
        "method": "eagle", "model": "e", "num_speculative_tokens": "auto", "draft_tree_branching": 4}
    with pytest.raises(ValueError):
        parse_method("ngram-b4", None)
    from specdecode.bench.report import _family

    assert _family("eagle-w2-k4", {"draft_tree_width": 2}) == "EAGLE-style head, tree of width 2"
    assert _family("eagle", {}) == "EAGLE-style head, dynamic tree"
    assert _family("eagle-w10-b8-k6", {"draft_tree_width": 10, "draft_tree_branching": 8}) == (
        "EAGLE-style head, tree of width 10, top-8 expansion")
    with pytest.raises(ValueError, match="--head"):
        parse_method("medusa", "d", {"eagle": "e"})
    with pytest.raises(ValueError):
        parse_method("ngram-tree", None)
    labelled = parse_method("eagle-nolookup:v4@int8", None, {"eagle": "e", "eagle:v4": "v4dir"})
    assert labelled.name == "eagle-nolookup:v4@int8" and labelled.quantization == "int8"
    assert labelled.speculative_config["model"] == "v4dir"
    with pytest.raises(ValueError, match="--head v5=DIR"):
        parse_method("eagle:v5", None, {"eagle": "e"})
    with pytest.raises(ValueError, match="take a label"):
        parse_method("ngram:v4", None)
    small = parse_method("draft-k4:small@gguf", "d", {"draft:small": "smollm"})
    assert small.speculative_config["model"] == "smollm" and small.quantization == "gguf"
    with pytest.raises(ValueError, match="--draft tiny=MODEL"):
        parse_method("draft:tiny", "d", {})
    q = parse_method("draft-k4@int8-dynamic", "d")
    assert (q.name, q.quantization, q.speculative_config["num_speculative_tokens"]) == ("draft-k4@int8-dynamic",
                                                                                        "int8-dynamic", 4)
    assert parse_method("plain@int4", None).speculative_config is None
    with pytest.raises(ValueError, match="target format"):
        parse_method("plain@int3", None)


def test_datasets_load_and_select():
    sb = load_prompts("spec_bench", ["summarization", "qa"], per_task=2)
    assert [(p.task, p.index) for p in sb] == [("summarization", 0), ("summarization", 1), ("qa", 0), ("qa", 1)]
    assert all(len(p.messages) == 1 and p.messages[0]["role"] == "user" for p in sb)
    tasks = {p.task for p in load_prompts("spec_bench", per_task=1)}
    assert tasks == {"mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"}
    he = load_prompts("humaneval", limit=1)[0]
    assert he.task == "code" and he.messages[0]["content"].startswith("Complete the following Python function:\n```")
    gs = load_prompts("gsm8k", limit=2)
    assert [p.task for p in gs] == ["gsm8k", "gsm8k"] and "ducks" in gs[0].messages[0]["content"]
    mt = load_prompts("mt_bench", ["coding"], per_task=3)
    assert len(mt) == 3 and mt[0].task == "coding"
    joined = load_prompts("mt_bench+gsm8k", ["math", "gsm8k"], per_task=2)
    assert [p.task for p in joined] == ["math", "math", "gsm8k", "gsm8k"]
    with pytest.raises(ValueError, match="no prompts for tasks"):
        load_prompts("gsm8k", ["nope"])
    with pytest.raises(ValueError, match="unknown dataset"):
        load_prompts("no-such-dataset")


def test_weight_bytes_excludes_embedding_and_counts_tied_head_once():
    import torch
    from torch import nn

    class M(nn.Module):
        def __init__(self, tie: bool) -> None:
            super().__init__()
            self.embed = nn.Embedding(100, 8)
            self.proj = nn.Linear(8, 8, bias=False)
            self.head = nn.Linear(8, 100, bias=False)
            if tie:
                self.head.weight = self.embed.weight
            self.register_buffer("rope", torch.zeros(50), persistent=False)

    untied = weight_bytes_per_token(M(False))
    assert untied["bytes"] == (64 + 800) * 4 and untied["embedding_bytes_excluded"] == 800 * 4
    tied = weight_bytes_per_token(M(True))
    assert tied["bytes"] == (64 + 800) * 4 and tied["embedding_bytes_excluded"] == 0
    assert memory_floor(10.0, 10**9) == pytest.approx(10.0)
    assert math.isinf(memory_floor(10.0, 0))


def test_weight_bytes_counts_packed_linear_tensors():
    import torch
    from torch import nn

    from specdecode.model.fast_linear import convert_linears

    model = nn.Sequential(nn.Linear(64, 32, bias=False))
    convert_linears(model, "int8")
    info = weight_bytes_per_token(model)
    assert info["bytes"] == 64 * 32 * 1 + 32 * 2  # int8 weight + bf16 scales
    model = nn.Sequential(nn.Linear(64, 64, bias=False).to(torch.bfloat16))  # whole AMX groups: no padding
    convert_linears(model, "bf16")
    assert weight_bytes_per_token(model)["bytes"] == 64 * 64 * 2


def test_weight_bytes_counts_int4_packed_and_scales_not_test_copy():
    from torch import nn

    from specdecode.model.fast_linear import convert_linears

    model = nn.Sequential(nn.Linear(64, 32, bias=False))
    convert_linears(model, "int4")
    lin = model[0]
    expected = lin.packed.numel() * lin.packed.element_size() + lin.scales_zeros.numel() * 2
    assert weight_bytes_per_token(model)["bytes"] == expected  # the `_dq` test copy is not read per token


def test_decode_rate_skips_prompts_without_a_decode_phase():
    rs = [dict(rec("m", "t", 0, 5, 1.0), decode_tokens_per_second=8.0),
          dict(rec("m", "t", 1, 1, 1.0), decode_tokens_per_second=None),
          dict(rec("m", "t", 2, 5, 1.0), decode_tokens_per_second=4.0)]
    assert stats.mean_decode_tokens_per_second(rs) == pytest.approx(6.0)
    assert stats.mean_decode_tokens_per_second([rec("hf", "t", 0, 5, 1.0)]) is None


def test_per_task_counts_and_joined_datasets():
    from specdecode.bench.datasets import parse_per_task

    assert parse_per_task("3") == 3
    assert parse_per_task("10,code=40") == {"*": 10, "code": 40}
    with pytest.raises(ValueError, match="TASK=N"):
        parse_per_task("code=x")
    prompts = load_prompts("spec_bench+humaneval", per_task={"*": 1, "code": 3})
    counts = {t: sum(p.task == t for p in prompts) for t in {p.task for p in prompts}}
    assert counts.pop("code") == 3 and set(counts.values()) == {1} and len(counts) == 6


def test_complete_prompts_keeps_prompts_every_method_measured():
    from specdecode.bench.stats import complete_prompts

    recs = [{"method": m, "task": "t", "prompt_index": i} for m in ("plain", "ngram") for i in range(3)]
    kept, n = complete_prompts(recs[:-1])  # ngram did not reach prompt 2
    assert n == 2 and {r["prompt_index"] for r in kept} == {0, 1} and len(kept) == 4


def test_resumed_run_state_appends_after_a_cut_off_line(tmp_path):
    from specdecode.bench.run_state import RECORDS_FILE, RunState, read_records

    state = RunState.start(tmp_path, {"model": "m"}, resume=False)
    state.add_record({"method": "plain", "task": "t", "prompt_index": 0})
    with (tmp_path / RECORDS_FILE).open("a") as f:
        f.write('{"method": "plain", "ta')  # a crash in the middle of a write
    resumed = RunState.start(tmp_path, {"model": "m"}, resume=True)
    assert resumed.done() == {("plain", "t", 0)}
    resumed.add_record({"method": "plain", "task": "t", "prompt_index": 1})
    assert [r["prompt_index"] for r in read_records(tmp_path / RECORDS_FILE)] == [0, 1]


def test_resumed_run_may_add_a_kind_of_head_but_not_change_one(tmp_path):
    from specdecode.bench.run_state import RunState

    RunState.start(tmp_path, {"model": "m", "heads": {"eagle": "/e"}}, resume=False)
    RunState.start(tmp_path, {"model": "m", "heads": {"eagle": "/e", "medusa": "/m"}}, resume=True)
    for heads in ({"eagle": "/other"}, {}):
        with pytest.raises(ValueError, match="other settings"):
            RunState.start(tmp_path, {"model": "m", "heads": heads}, resume=True)


def test_median_probe() -> None:
    from specdecode.bench.bandwidth import median_probe

    probes = [{"read_gb_per_s": v, "copy_gb_per_s": 2 * v} for v in (30.0, 60.0, 35.0)]
    best = median_probe(probes)
    assert (best["read_gb_per_s"], best["copy_gb_per_s"]) == (35.0, 70.0)
    assert best["probes_read_gb_per_s"] == [30.0, 60.0, 35.0]
    assert median_probe(probes[:2])["read_gb_per_s"] == 30.0  # the lower of two
    with pytest.raises(ValueError):
        median_probe([])
