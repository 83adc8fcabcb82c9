"""Pure parts of structured outputs and tool calling: draft pruning, params, tool-call parsing (whole and
streamed) on canned model output in the Hermes / Qwen2.5 and Llama 3.x formats."""

from __future__ import annotations

import json

import pytest
import torch
from test_engine_lossless import TARGET, VOCAB, _NoText, _transition_logits
from test_structured_lossless import MarkovGrammar

from specdecode import SamplingParams, StructuredOutputsParams
from specdecode.engine.constrain import constrain_row, fit_forced
from specdecode.engine.core import Engine
from specdecode.engine.plan import RowTree
from specdecode.engine.prefill_share import PrefillShares
from specdecode.engine.sequence import Sequence
from specdecode.server.tools import ToolCallStream, parse_tool_calls, template_format


def test_point_mass_tree_loses_forbidden_nodes_and_their_subtrees() -> None:
    # after 1: {0, 3, 5}; after 0: {1, 2, 4}; after 3: {0, 4, 5}
    row = RowTree([1, 0, 2, 3, 4, 1, 4], [-1, 0, 0, 0, 1, 2, 3], None, 6)
    matcher = MarkovGrammar(1)
    pruned, masks = constrain_row(row, matcher)
    assert pruned.tokens == [1, 0, 3, 4, 4] and pruned.parents == [-1, 0, 0, 1, 2]
    assert pruned.drafted == 4 and masks.shape == (5, 6)
    assert masks[0].nonzero().flatten().tolist() == [0, 3, 5]
    assert masks[1].nonzero().flatten().tolist() == [1, 2, 4]
    assert matcher.path == [1]  # left where it stood


def test_sampled_chain_keeps_its_first_forbidden_token_as_a_leaf() -> None:
    probs = torch.full((4, 6), 1 / 6)
    row = RowTree([1, 0, 2, 5, 0], [-1, 0, 1, 2, 3], probs, 4)  # 1 -> 0 ok, 0 -> 2 ok, 2 -> 5 forbidden
    pruned, masks = constrain_row(row, MarkovGrammar(1))
    assert pruned.tokens == [1, 0, 2, 5] and pruned.draft_probs.shape == (4, 6)
    assert bool(masks[3].all())  # never read: the forbidden token is always rejected


def test_a_whole_chain_gets_the_forced_tokens() -> None:
    row = RowTree([0, 4, 5], [-1, 0, 1], None, 2)  # 0 -> 4 -> 5, then 5 forces 0
    matcher = MarkovGrammar(0)
    extended, masks = constrain_row(row, matcher, forced_room=4)
    assert extended.tokens == [0, 4, 5, 0] and extended.parents == [-1, 0, 1, 2] and extended.drafted == 2
    assert masks.shape == (4, 6) and matcher.path == [0]
    assert constrain_row(row, MarkovGrammar(0), forced_room=0)[0].tokens == [0, 4, 5]
    probs = torch.full((2, 6), 1 / 6)
    sampled, _ = constrain_row(RowTree([0, 4, 5], [-1, 0, 1], torch.cat([probs, torch.zeros(1, 6)]), 2),
                               MarkovGrammar(0), forced_room=4)
    assert sampled.draft_probs[2].tolist() == [1, 0, 0, 0, 0, 0] and not sampled.draft_probs[3].any()


def _forced_rows() -> tuple[list[RowTree], list[torch.Tensor | None]]:
    sampled = torch.zeros(6, 6)
    sampled[0] = 1 / 6
    sampled[torch.arange(1, 5), torch.tensor([2, 3, 4, 5])] = 1.0  # the forced nodes' one-hot rows
    long = RowTree([0, 1, 2, 3, 4, 5], [-1, 0, 1, 2, 3, 4], sampled, 1, forced=4)  # 1 drafted, 4 forced
    return [long, RowTree([0], [-1], None, 0)], [torch.ones(6, 6, dtype=torch.bool), None]


def test_forced_tails_stay_when_width_is_cheap() -> None:
    rows, masks = _forced_rows()
    fit_forced(rows, masks, [0.5, 1.0], lambda tokens: 1.0, 2.5)  # a flat forward: every forced node is free
    assert len(rows[0].tokens) == 6 and rows[0].forced == 4 and masks[0].shape == (6, 6)


def test_forced_tails_are_trimmed_to_the_width_that_pays() -> None:
    rows, masks = _forced_rows()
    # Seconds grow with every padded node: width 2 gives 3 / 4 tokens per second, width 6 only 5 / 12.
    fit_forced(rows, masks, [0.5, 1.0], lambda tokens: float(tokens), 3.0)
    long = rows[0]
    assert long.tokens == [0, 1] and long.parents == [-1, 0] and long.forced == 0 and long.drafted == 1
    assert masks[0].shape == (2, 6) and masks[1] is None and rows[1].tokens == [0]
    assert long.draft_probs is not None and long.draft_probs.shape == (2, 6) and not long.draft_probs[1].any()


def test_structured_params() -> None:
    p = SamplingParams(structured_outputs={"json": {"type": "object", "b": 1, "a": 2}})
    assert p.structured_outputs.kind == "json" and hash(p)
    assert StructuredOutputsParams(choice=["a", "b"]).choice == ("a", "b")
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", grammar="start: x")
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()


HERMES = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TWO = ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
       '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>')
LLAMA = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
BARE = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def test_parse_hermes_calls() -> None:
    content, calls = parse_tool_calls(HERMES, "hermes")
    assert content == "Let me check."
    assert calls == [{"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}]
    _, calls = parse_tool_calls(TWO, "hermes")
    assert [json.loads(c["arguments"]) for c in calls] == [{"a": 1, "b": 2}, {"a": 3, "b": 4}]
    assert parse_tool_calls("no call here", "hermes") == ("no call here", [])
    broken = "<tool_call>\n{not json}\n</tool_call>"
    assert parse_tool_calls(broken, "hermes") == (broken, [])
    _, calls = parse_tool_calls('<tool_call>\n{"name": "f", "arguments": {}}', "hermes")  # EOS before the tag
    assert calls == [{"name": "f", "arguments": "{}"}]
    # An untagged call object (small Qwen models write these) is a call; other JSON answers stay text.
    assert parse_tool_calls(BARE, "hermes") == (None, [{"name": "get_weather", "arguments": '{"city": "Paris"}'}])
    answer = '{"name": "Bob", "age": 3}'
    assert parse_tool_calls(answer, "hermes") == (answer, [])


def test_parse_llama_calls() -> None:
    assert parse_tool_calls(LLAMA, "llama") == (None, [{"name": "get_weather", "arguments": '{"city": "Paris"}'}])
    assert parse_tool_calls("<|python_tag|>" + LLAMA, "llama")[1][0]["name"] == "get_weather"
    assert parse_tool_calls("The answer is 4.", "llama") == ("The answer is 4.", [])


@pytest.mark.parametrize(("text", "fmt"), [(HERMES, "hermes"), (TWO, "hermes"), (LLAMA, "llama"),
                                           ("plain text answer", "hermes"), ("plain text", "llama"),
                                           (BARE, "hermes"), ('{"name": "Bob", "age": 3}', "hermes")])
@pytest.mark.parametrize("size", [1, 3, 7])
def test_streamed_calls_reassemble_to_the_whole_parse(text: str, fmt: str, size: int) -> None:
    stream = ToolCallStream(fmt)  # type: ignore[arg-type]
    events = []
    for i in range(0, len(text), size):
        events += stream.feed(text[i : i + size])
    events += stream.finish()
    content, calls = parse_tool_calls(text, fmt)  # type: ignore[arg-type]
    assert [v for k, v in events if k == "call"] == calls
    streamed = "".join(v for k, v in events if k == "content")
    assert streamed.strip() == (content or "").strip()


def test_template_format() -> None:
    assert template_format("{{ '<tool_call>' }} {% if tools %}") == ("hermes", True)
    assert template_format("{% if tools %}{{ 'parameters' }}{% endif %}") == ("llama", True)
    assert template_format("{% for m in messages %}{{ m.content }}{% endfor %}") == ("hermes", False)


def test_tool_tags_that_are_tokens_are_matched_as_tokens(tiny_llama_dir) -> None:  # noqa: ANN001
    """Qwen2.5 has <tool_call> as one added token: the grammar names the token, and the model's spelling
    of a call (the tag token, then JSON as templates write it) is accepted to the end."""
    pytest.importorskip("llguidance")
    from specdecode.model.tokenizer import Tokenizer
    from specdecode.server.protocol import ChatCompletionRequest
    from specdecode.server.tools import tool_grammar, tool_plan
    from specdecode.structured.matcher import build_matcher

    tok = Tokenizer.from_dir(tiny_llama_dir)
    tok.hf.add_tokens(["<tool_call>", "</tool_call>"])
    params = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    body = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "x"}], "tool_choice": "required",
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": params}}]})
    plan = tool_plan(body, tok.hf)
    assert plan is not None and plan.tags[0].startswith("<[")
    matcher = build_matcher(tool_grammar(plan), tok, len(tok.hf))
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    ids = tok.hf.encode(text, add_special_tokens=False)
    assert ids[0] == tok.hf.convert_tokens_to_ids("<tool_call>")
    assert all(matcher.consume(t) for t in ids) and matcher.is_stopped()


def test_python_api_structured_outputs(tiny_llama_dir) -> None:  # noqa: ANN001
    """`SamplingParams(structured_outputs=...)` through `LLM.generate`: the regex holds, and prompt lookup
    gives plain decoding's tokens."""
    pytest.importorskip("llguidance")
    import re

    from specdecode import LLM

    params = SamplingParams(max_tokens=40, temperature=0.0,
                            structured_outputs=StructuredOutputsParams(regex="[a-z]{2,6}( [0-9]{1,3}){2}"))
    prompts = ["def add(a, b):", "The quick brown"]
    plain = LLM(str(tiny_llama_dir), dtype="fp32").generate(prompts, params)
    spec = LLM(str(tiny_llama_dir), dtype="fp32", speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    fast = spec.generate(prompts, params)
    assert [o.token_ids for o in fast] == [o.token_ids for o in plain]
    for o in plain:
        assert re.fullmatch("[a-z]{2,6}( [0-9]{1,3}){2}", o.text) and o.finish_reason == "stop", o.text


def test_first_token_of_every_prefill_path_follows_the_grammar(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt prefilled in chunks while a row decodes, and two sibling choices that copy its prefill: each
    first token comes from the masked logits, through the choice's own matcher, and so do its logprobs."""
    copied: list[bool] = []
    real_copy = PrefillShares.copy_into

    def copy(self, *args):  # noqa: ANN001, ANN002, ANN202
        shared = real_copy(self, *args)
        copied.append(shared is not None)
        return shared

    monkeypatch.setattr(PrefillShares, "copy_into", copy)
    engine = Engine(TARGET, 64, max_num_seqs=4, max_waiting=None, max_num_batched_tokens=16)
    cpu = torch.device("cpu")
    busy = Sequence("busy", [1, 2], SamplingParams(max_tokens=20, temperature=0), _NoText(), VOCAB, cpu, 0)
    engine.add(busy)
    engine.step()  # a row decodes: the next prompt is prefilled in chunks
    prompt = [1, 2, 3, 4, 5] * 7 + [0]  # after 0 the target's argmax (3) is forbidden
    params = SamplingParams(max_tokens=2, temperature=0, logprobs=1, ignore_eos=True)
    group = object()
    seqs = [Sequence(str(i), prompt, params, _NoText(), VOCAB, cpu, 0, matcher=MarkovGrammar(0)) for i in range(3)]
    for seq in seqs:
        seq.prefill_group = group
        engine.add(seq)
    while engine.has_work():
        engine.step()
    assert copied.count(True) == 2  # both siblings copied the chunked prefill
    logits = _transition_logits()[0].clone()  # [V] after token 0
    forbidden = [t for t in range(VOCAB) if t not in (1, 2, 4)]
    logits[forbidden] = float("-inf")
    want = torch.log_softmax(logits, -1)
    for seq in seqs:
        first = seq.output_ids[0]
        assert first == int(logits.argmax()) and first != 3
        assert seq.logprobs is not None and seq.logprobs[0].logprob == pytest.approx(float(want[first]), abs=1e-4)
        assert seq.logprobs[0].top[0][0] == first
        assert seq.matcher.path[:2] == [0, first]  # each choice's own matcher advanced
