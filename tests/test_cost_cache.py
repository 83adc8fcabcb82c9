"""The cost cache: forward costs measured once per machine and set-up, kept under SPECDECODE_HOME, and what earlier
requests of a pair measured (their acceptance: the prior of a new row; their length: the catch-up's horizon)."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from tiny_helpers import GREEDY, tiny_prompts

from specdecode import LLM, SamplingParams
from specdecode.engine import cost_cache
from specdecode.engine.adaptive import DEFAULT_PRIOR, AdaptiveK
from specdecode.engine.history import PRIOR_WEIGHT, RequestHistory
from specdecode.engine.measure import CostMeasurement
from specdecode.engine.schedule import CATCH_UP_HORIZON_TOKENS
from specdecode.engine.sequence import Sequence
from specdecode.proposers import draft_rows

NGRAM = {"method": "ngram"}


@pytest.fixture(scope="module")
def module_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private SPECDECODE_HOME for this module (the kernels it compiles are compiled once)."""
    return tmp_path_factory.mktemp("home")


@pytest.fixture
def cached(module_home: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The cost cache on, with no costs yet, under a private SPECDECODE_HOME; the cache's directory."""
    monkeypatch.setenv("SPECDECODE_HOME", str(module_home))
    monkeypatch.setenv("SPECDECODE_COST_CACHE", "1")
    shutil.rmtree(module_home / "costs", ignore_errors=True)
    return module_home / "costs"


def _llm(model: Path, spec: dict | None = None) -> LLM:
    return LLM(str(model), dtype="fp32", device="cpu", speculative_config=spec or NGRAM, max_model_len=256)


def _no_timing(monkeypatch: pytest.MonkeyPatch) -> None:
    """From now on any forward timing or draft step measurement fails the test."""
    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("measured although the costs are cached")

    monkeypatch.setattr(CostMeasurement, "_time", fail)
    monkeypatch.setattr(draft_rows, "draft_step_costs", fail)


def test_a_miss_measures_and_logs_then_a_new_process_reads_the_costs(
        tiny_llama_dir: Path, cached: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="specdecode"):
        first = _llm(tiny_llama_dir)
    measuring = [r.levelno for r in caplog.records if r.getMessage().startswith(("measuring", "measured"))]
    assert measuring == [logging.INFO, logging.INFO]  # before (a first run is slower) and after, with its time
    files = list(cached.glob("*.json"))
    assert first.cost_cache is not None and files == [first.cost_cache.path]
    record = json.loads(files[0].read_text())
    assert record["costs"]["rows"] == 1 and record["identity"]["machine"]["cpu"] == cost_cache.cpu_identity()

    caplog.clear()
    _no_timing(monkeypatch)
    with caplog.at_level(logging.DEBUG, logger="specdecode"):
        second = _llm(tiny_llama_dir)
    assert [r.levelno for r in caplog.records if r.getMessage().startswith(("measur", "forward costs"))] == [
        logging.DEBUG]
    assert second.cost == first.cost and second.measurement is not None and second.measurement.rows == 1
    ids = tiny_prompts(second)
    assert [o.token_ids for o in second.generate(ids[:1], GREEDY)] == [o.token_ids for o in first.generate(ids[:1],
                                                                                                          GREEDY)]


def test_batch_shapes_measured_once_are_kept_for_the_next_process(
        tiny_llama_dir: Path, cached: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = _llm(tiny_llama_dir)
    first.generate(tiny_prompts(first), SamplingParams(max_tokens=2, temperature=0))  # two rows: measured now
    assert first.measurement is not None and first.measurement.rows == 2
    _no_timing(monkeypatch)
    second = _llm(tiny_llama_dir)
    assert second.measurement is not None and second.measurement.rows == 2
    second.generate(tiny_prompts(second), SamplingParams(max_tokens=2, temperature=0))
    assert second.batch_engine(max_num_seqs=2).cost == first.cost


def test_another_cpu_or_model_or_thread_count_measures_again(
        tiny_llama_dir: Path, tiny_llama_other_dir: Path, cached: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _llm(tiny_llama_dir)
    assert len(list(cached.glob("*.json"))) == 1
    _llm(tiny_llama_dir)  # the same set-up: the same file
    assert len(list(cached.glob("*.json"))) == 1
    _llm(tiny_llama_other_dir)
    assert len(list(cached.glob("*.json"))) == 2
    real = cost_cache.cpu_identity()
    monkeypatch.setattr(cost_cache, "cpu_identity", lambda: {**real, "flags": [*real["flags"], "amx_bf16_x"]})
    _llm(tiny_llama_dir)
    assert len(list(cached.glob("*.json"))) == 3
    monkeypatch.setenv("SPECDECODE_AMX", "0")  # a kernel switch
    _llm(tiny_llama_dir)
    assert len(list(cached.glob("*.json"))) == 4


def test_a_changed_model_file_measures_again(tmp_path: Path, tiny_llama_dir: Path, cached: Path) -> None:
    model = shutil.copytree(tiny_llama_dir, tmp_path / "model")
    _llm(model)
    weights = next(model.glob("*.safetensors"))
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # rewritten in place
    _llm(model)
    assert len(list(cached.glob("*.json"))) == 2


def test_the_draft_models_costs_are_cached_and_the_output_stays_exact(
        tiny_llama_dir: Path, cached: Path, monkeypatch: pytest.MonkeyPatch, plain_tiny) -> None:
    _, plain = plain_tiny
    for tree_width in (1, 3):
        spec = {"method": "draft", "model": str(tiny_llama_dir), "draft_tree_width": tree_width}
        first = _llm(tiny_llama_dir, spec)
        assert first.cost is not None and first.cost.draft_step_seconds > 0
        assert [o.token_ids for o in first.generate(tiny_prompts(first), GREEDY)] == plain
        with monkeypatch.context() as mp:
            _no_timing(mp)  # neither the target's forwards nor the draft's step are timed again
            second = _llm(tiny_llama_dir, spec)
            assert second.cost == first.cost
            assert [o.token_ids for o in second.generate(tiny_prompts(second), GREEDY)] == plain
            assert second.batch_engine(max_num_seqs=2).proposer.step_cost_hint() == first.cost.draft_step_seconds


def test_the_switch_turns_the_cache_off(tiny_llama_dir: Path, cached: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECDECODE_COST_CACHE", "0")
    llm = _llm(tiny_llama_dir)
    assert llm.cost_cache is None and llm.cost is not None and not cached.exists()


def test_an_unreadable_or_foreign_file_is_measured_over(
        tiny_llama_dir: Path, cached: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = _llm(tiny_llama_dir).cost_cache.path  # type: ignore[union-attr]
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="specdecode"):
        llm = _llm(tiny_llama_dir)
    assert "unreadable" in caplog.text and llm.cost is not None
    assert json.loads(path.read_text())["costs"]["rows"] == 1  # written anew
    record = json.loads(path.read_text())
    record["costs"]["medians"] = record["costs"]["medians"][:1]  # not a whole measurement
    path.write_text(json.dumps(record))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="specdecode"):
        assert _llm(tiny_llama_dir).measurement.rows == 1  # type: ignore[union-attr]
    assert "incomplete" in caplog.text


# ---- what earlier requests measured ------------------------------------------------------------------------------


class _Seq:
    def __init__(self, num_output: int, params: SamplingParams, reason: str = "stop") -> None:
        self.num_output, self.params, self.finish_reason = num_output, params, reason


def _policy(observed: int, accepted: int) -> AdaptiveK:
    policy = AdaptiveK(fixed_k=4)
    policy.observed_positions, policy.accepted_positions = observed, accepted
    return policy


def test_the_prior_is_the_measured_acceptance_of_earlier_requests() -> None:
    history = RequestHistory()
    assert history.prior() == DEFAULT_PRIOR  # nothing measured yet
    text = SamplingParams(max_tokens=500)
    for _ in range(20):
        history.finished(_policy(10, 9), _Seq(40, text))  # type: ignore[arg-type]
    history.finished(_policy(10, 0), _Seq(40, text, "abort"))  # type: ignore[arg-type]
    history.finished(None, _Seq(40, text))  # type: ignore[arg-type]  # never drafted: says nothing of acceptance
    assert history.acceptance_requests == 20 and history.acceptance == pytest.approx(0.9)
    assert history.prior() == DEFAULT_PRIOR  # its own requests do not change its decisions (seeded samples repeat)
    later = RequestHistory(history.state())  # the next process
    assert later.prior() == pytest.approx((20 * 0.9 + PRIOR_WEIGHT * DEFAULT_PRIOR) / (20 + PRIOR_WEIGHT))


def test_the_catch_up_horizon_is_the_requests_expected_length() -> None:
    history = RequestHistory()
    text, bench = SamplingParams(max_tokens=500), SamplingParams(max_tokens=500, ignore_eos=True)
    assert history.expected_length(text) == CATCH_UP_HORIZON_TOKENS
    assert history.expected_length(bench) == 500  # only max_tokens ends it
    for _ in range(30):
        history.finished(None, _Seq(40, text))  # type: ignore[arg-type]
        history.finished(None, _Seq(500, bench))  # type: ignore[arg-type]  # a known length teaches nothing
    assert history.length_requests == 30
    later = RequestHistory(history.state())
    assert later.expected_length(text) == pytest.approx((30 * 40 + PRIOR_WEIGHT * 256) / (30 + PRIOR_WEIGHT))
    assert later.expected_length(bench) == 500


def test_a_damaged_history_falls_back_to_the_assumed_values() -> None:
    history = RequestHistory({"acceptance": 7.0, "acceptance_requests": 3, "output_tokens": "x", "length_requests": 1})
    assert history.prior() == DEFAULT_PRIOR and history.expected_length(SamplingParams()) == CATCH_UP_HORIZON_TOKENS


def test_a_new_process_starts_its_rows_from_the_pairs_measured_acceptance(tiny_llama_dir: Path, cached: Path) -> None:
    prompt = [5, 9, 14, 3, 22, 9, 14, 3, 5, 9, 14, 3] * 3  # repeats: prompt lookup drafts
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=["never in this text"])  # no EOS,
    first = _llm(tiny_llama_dir)  # but the length is not known in advance: it counts
    first.generate([prompt, prompt[1:]], params)
    saved = json.loads(first.cost_cache.path.read_text())["history"]  # type: ignore[union-attr]
    assert saved == first.history.state() and saved["length_requests"] == 2 and saved["acceptance_requests"] == 2
    second = _llm(tiny_llama_dir)
    prior = second.history.prior()
    assert prior == pytest.approx(RequestHistory(first.history.state()).prior()) and prior != DEFAULT_PRIOR
    assert second.history.expected_length(params) == pytest.approx(
        RequestHistory(first.history.state()).expected_length(params)) != CATCH_UP_HORIZON_TOKENS
    sampled = SamplingParams(max_tokens=12, temperature=0.8, seed=7, ignore_eos=True)
    assert len({tuple(second.generate([prompt], sampled)[0].token_ids) for _ in range(3)}) == 1  # seeded: repeats
    engine = second.batch_engine(max_num_seqs=1)
    seq = second.new_sequence(prompt, SamplingParams(max_tokens=4, temperature=0))
    engine.add(seq)
    engine.step()
    assert isinstance(seq, Sequence) and engine.running[0].policy.tracker.prior == prior  # type: ignore[union-attr]


def test_the_catch_up_is_spread_over_the_expected_length_not_max_tokens() -> None:
    from specdecode.engine.schedule import catch_up_share

    assert catch_up_share(50, 0.01, 10_000, 1.0, dip=False, expected_length=40) == pytest.approx(0.5 / 40)
    assert catch_up_share(50, 0.01, 20, 1.0, dip=False, expected_length=40) == pytest.approx(0.5 / 20)
    assert catch_up_share(50, 0.01, 10_000, 2.0, dip=False, expected_length=10_000) == pytest.approx(0.5 / 5000)


def test_a_cache_hit_warms_the_target_up_untimed(tiny_llama_dir: Path, cached: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing is timed on a hit, but every one-row forward shape runs once at load, so that the first request
    does not pay the first calls' costs."""
    first = _llm(tiny_llama_dir)
    assert first.measurement is not None and not first.measurement.restored
    _no_timing(monkeypatch)
    shapes: list[int] = []
    real = CostMeasurement.warm_up

    def counted(self: CostMeasurement) -> None:
        shapes.extend(self.ts)
        real(self)

    monkeypatch.setattr(CostMeasurement, "warm_up", counted)
    second = _llm(tiny_llama_dir)
    assert second.measurement is not None and second.measurement.restored
    assert shapes == second.measurement.ts and len(shapes) > 1


def test_the_draft_is_priced_against_a_target_forward_timed_around_it(tiny_llama_dir: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A slow spell while the draft is timed (here: every forward around it takes twice the measured one-token
    time) must not make the draft look dearer against the target: its times are scaled to the target's."""
    from specdecode.model.load import load_model

    class Fixed:
        capabilities = type("Caps", (), {"catch_up": True, "trees": False, "lookup": False})()

        def step_cost_hint(self) -> float:
            return 0.010

        def catch_up_token_seconds(self) -> float:
            return 0.002

    target = load_model(tiny_llama_dir, dtype=torch.float32, device="cpu").model
    m = CostMeasurement(target, Fixed(), 4, 256)  # type: ignore[arg-type]
    m.cost(1)
    one = m.medians[(1, 1)]
    m.draft = None
    monkeypatch.setattr(CostMeasurement, "_one_token_seconds", lambda self: 2 * one)
    assert m._draft_costs() == pytest.approx((0.005, 0.001))
