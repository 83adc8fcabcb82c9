"""`specdecode bench` end to end on a tiny random model: files, summary fields, losslessness in fp32."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specdecode.bench.report import PLOTS
from specdecode.cli import main
from specdecode.heads.persist import new_head, save_head
from specdecode.model.load import load_model

PROMPTS = [
    {"category": "code", "turns": ["def add(a, b):"]},
    {"category": "prose", "turns": ["The quick brown fox jumps over the lazy dog."]},
    {"category": "code", "turns": ["for i in range(10):\n    print(i * i)"]},
    {"category": "prose", "turns": ["Speculative decoding drafts tokens."]},
    {"category": "code", "turns": ["import numpy as np"]},  # beyond --per-task 2
]


@pytest.mark.timeout(180)
def test_bench_end_to_end(tiny_llama_dir: Path, tiny_sentencepiece_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    out = tmp_path / "out"
    target = load_model(str(tiny_llama_dir), "fp32", "cpu").model
    save_head(new_head(target, "eagle", torch.arange(target.config.vocab_size)), tmp_path / "head")
    rc = main([
        "bench", "--model", str(tiny_llama_dir), "--draft",
        f"{tiny_llama_dir},sp={tiny_sentencepiece_dir}",  # a second draft under a label: draft:sp
        "--head",
        f"{tmp_path / 'head'},v2={tmp_path / 'head'}",  # the same head under a label: eagle:v2
        "--methods", "plain,ngram,draft,eagle,eagle-chain,plain@int8-dynamic,eagle:v2,draft:sp",
        "--dataset", str(data), "--per-task", "2", "--max-tokens", "8", "--dtype", "fp32",
        "--peers", "transformers,llama.cpp", "--bandwidth-gb", "0.05", "--no-progress", "--out", str(out),
    ])
    assert rc == 0
    for name in ("records.jsonl", "summary.json", "summary.md", *PLOTS):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name

    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    ours = [r for r in records if r["engine"] == "specdecode"]
    assert len(ours) == 8 * 4
    for r in records:
        for key in ("method", "task", "prompt_index", "prompt_tokens", "output_tokens", "seconds",
                    "tokens_per_second", "steps", "mean_accepted_length", "acceptance_rate", "token_ids"):
            assert key in r
        assert 1 <= r["output_tokens"] <= 8 and len(r["token_ids"]) == r["output_tokens"]
    assert {r["task"] for r in records} == {"code", "prose"}

    s = json.loads((out / "summary.json").read_text())
    for key in ("command", "machine", "config", "protocol", "methods", "tasks", "by_method", "bandwidth",
                "memory_floor", "notes"):
        assert key in s, key
    assert s["methods"][:5] == ["plain", "ngram", "draft", "eagle", "eagle-chain"]
    assert s["tasks"] == ["code", "prose"]
    for method in ("plain", "ngram", "draft", "eagle", "eagle-chain"):
        entry = s["by_method"][method]
        for scope in [entry["overall"], *entry["tasks"].values()]:
            for key in ("tokens_per_second", "speedup", "mean_accepted_length", "acceptance_rate",
                        "acceptance_by_position", "identical_rate", "draft_seconds", "verify_seconds"):
                assert key in scope, (method, key)
        assert entry["overall"]["identical_rate"] == 1.0  # fp32 greedy: speculation is lossless
        assert entry["resources"]["peak_rss_bytes"] > 0
    for method in ("plain", "plain@int8-dynamic"):  # plain engines alone, each in a child process
        assert s["by_method"][method]["resources"]["alone_peak_rss_bytes"] > 0
    assert "alone_peak_rss_bytes" not in s["by_method"]["ngram"]["resources"]
    assert s["by_method"]["plain"]["overall"]["speedup"] == pytest.approx(1.0)
    assert s["by_method"]["plain"]["overall"]["mean_accepted_length"] == pytest.approx(1.0)
    floor = s["memory_floor"]
    assert floor["weight_bytes_per_token"] > 0 and floor["floor_tokens_per_second"] > 0
    assert floor["plain_fraction_of_floor"] > 0 and floor["plain_decode_tokens_per_second"] > 0

    # peers: transformers loads the HF directory; llama.cpp needs a GGUF (or is not installed): a note
    assert {"hf-plain", "hf-assisted", "hf-assisted-k4", "hf-prompt-lookup"} <= set(s["methods"])
    assert s["by_method"]["hf-plain"]["overall"]["mean_accepted_length"] is None
    assert any(n.startswith("llama.cpp: skipped") for n in s["notes"])

    md = (out / "summary.md").read_text()
    assert "## Overall" in md and "## code" in md and "## prose" in md and "specdecode bench --model" in md
    assert "of the floor" in md and "peak RSS alone (GiB)" in md
    assert set(s["memory_floors"]) == {"plain", "plain@int8-dynamic"}
    assert s["memory_floors"]["plain@int8-dynamic"]["weight_bytes_per_token"] < floor["weight_bytes_per_token"] / 3
    assert "### Memory floor by target format" in md
    assert "## Comparison table" in md and "| eagle | EAGLE-style head, dynamic tree |" in md
    assert "| eagle-chain | EAGLE-style head, chain |" in md
    assert "| eagle:v2 | EAGLE-style head v2, dynamic tree |" in md
    assert s["by_method"]["eagle:v2"]["overall"]["identical_rate"] == 1.0
    assert s["by_method"]["draft:sp"]["overall"]["identical_rate"] == 1.0  # another tokenizer drafts losslessly
    assert "| plain@int8-dynamic | autoregressive (no speculation), int8-dynamic target |" in md
    res = s["by_method"]["eagle"]["resources"]
    assert res["speculation_bytes"] > 0 and res["target_weight_bytes"] > 0
    assert s["by_method"]["plain"]["resources"]["speculation_bytes"] == 0


def test_llamacpp_peer_with_a_fake_module(monkeypatch: pytest.MonkeyPatch) -> None:
    """The llama.cpp peer's token loop (stop at EOS / max tokens, no KV reuse), without the real package."""
    import importlib.machinery
    import sys
    import types

    from specdecode.bench.peer_base import PeerContext
    from specdecode.bench.peers import make_peers

    made = []

    class FakeLlama:
        def __init__(self, model_path, n_threads, n_ctx, verbose, seed, draft_model, logits_all):
            self.draft_model, self.resets, self.closed = draft_model, 0, False
            # llama-cpp-python sizes its logits buffer by this argument: a draft needs every row
            assert logits_all == (draft_model is not None)
            made.append(self)

        def token_eos(self):
            return 99

        def reset(self):
            self.resets += 1

        def generate(self, ids, **kw):
            assert kw["temp"] == 0.0 and kw["top_k"] == 1 and kw["reset"] is True
            yield from ids[::-1]  # "generates" the prompt reversed, forever after
            while True:
                yield 7

        def close(self):
            self.closed = True

    class FakeLookup:
        def __init__(self, num_pred_tokens):
            self.num_pred_tokens = num_pred_tokens

    root = types.ModuleType("llama_cpp")
    root.__spec__ = importlib.machinery.ModuleSpec("llama_cpp", None)
    root.Llama = FakeLlama
    spec_mod = types.ModuleType("llama_cpp.llama_speculative")
    spec_mod.LlamaPromptLookupDecoding = FakeLookup
    monkeypatch.setitem(sys.modules, "llama_cpp", root)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_speculative", spec_mod)

    ctx = PeerContext(target_path=Path("/models/m.gguf"), draft_path=None, eos_token_id=5, max_tokens=4)
    peers, notes = make_peers(["llama.cpp"], ctx)
    assert notes == [] and len(peers) == 1
    peer = peers[0]
    assert peer.method_names() == ["llamacpp-plain", "llamacpp-prompt-lookup"]
    plain, lookup = peer.open()
    assert plain.generate([1, 2, 3]) == [3, 2, 1, 7]  # max tokens
    assert plain.generate([1, 5, 3]) == [3, 5]  # the target's EOS
    assert lookup.generate([99, 2]) == [2, 99]  # llama.cpp's own EOS
    assert made[0].resets == 2 and made[0].draft_model is None and made[1].draft_model.num_pred_tokens == 10
    peer.close()
    assert all(m.closed for m in made)

    hf_dir_ctx = PeerContext(target_path=Path("/models/hf-dir"), draft_path=None, eos_token_id=5, max_tokens=4)
    peers, notes = make_peers(["llamacpp"], hf_dir_ctx)
    assert peers == [] and "needs a GGUF" in notes[0]


@pytest.mark.timeout(180)
def test_bench_rounds_and_resume(tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """An interrupted run resumed with --resume re-measures only what is missing; other settings are refused."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    out = tmp_path / "out"
    args = ["bench", "--model", str(tiny_llama_dir), "--methods", "plain,ngram", "--dataset", str(data),
            "--max-tokens", "6", "--dtype", "fp32", "--peers", "transformers", "--peer-methods", "hf-plain",
            "--round-size", "2", "--no-memory-floor", "--no-plots", "--no-progress", "--no-peak-rss-alone",
            "--out", str(out)]
    assert main(args) == 0
    full = (out / "records.jsonl").read_text().splitlines()
    assert len(full) == 3 * len(PROMPTS)
    order = [(json.loads(line)["method"], json.loads(line)["prompt_index"]) for line in full]
    # round 1 = the first prompt of each task (code 0, prose 0), every method on it before round 2
    assert order[:6] == [("plain", 0), ("plain", 0), ("ngram", 0), ("ngram", 0), ("hf-plain", 0), ("hf-plain", 0)]

    # a crash: the last 4 records are lost and the final line is cut in half
    kept = full[:-4]
    (out / "records.jsonl").write_text("\n".join(kept) + "\n" + full[-4][:20])
    # a report of the records so far, measuring nothing
    assert main([*args, "--resume", "--report-only"]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["num_prompts_complete"] < len(PROMPTS) and len(s["sessions"]) == 1
    assert "partial run" in (out / "summary.md").read_text()
    assert (out / "records.jsonl").read_text().splitlines() == [*kept, full[-4][:20]]  # left alone
    assert main([*args, "--report-only"]) != 0  # needs a stored run
    assert main([*args, "--resume"]) == 0
    resumed = (out / "records.jsonl").read_text().splitlines()
    assert resumed[: len(kept)] == kept and len(resumed) == len(full)
    s = json.loads((out / "summary.json").read_text())
    assert s["num_prompts_complete"] == len(PROMPTS) and len(s["sessions"]) == 2
    assert s["by_method"]["ngram"]["overall"]["identical_rate"] == 1.0
    assert "resumed:" in (out / "summary.md").read_text()

    # --redo measures a method again and leaves the others' records as they were
    assert main([*args, "--resume", "--redo", "ngram"]) == 0
    redone = (out / "records.jsonl").read_text().splitlines()
    assert len(redone) == len(full)
    assert [r for r in redone if '"ngram"' not in r] == [r for r in resumed if '"ngram"' not in r]

    capsys.readouterr()
    assert main([*[a if a != "6" else "7" for a in args], "--resume"]) != 0
    assert "max_tokens: 6 -> 7" in capsys.readouterr().err
    assert main([*args[:-1], str(tmp_path / "elsewhere"), "--resume"]) != 0
    assert "no run to resume" in capsys.readouterr().err
    assert main([*args, "--resume", "--flat-verify-cost"]) != 0  # sized for another cost: not comparable
    assert "flat_verify_cost: False -> True" in capsys.readouterr().err

    # --flat-verify-cost: our adaptive methods size k as on a GPU, and the summary says so
    flat = tmp_path / "flat"
    assert main([*args[:-1], str(flat), "--flat-verify-cost"]) == 0
    assert "ngram: k and tree sized for a flat verification cost" in (flat / "summary.md").read_text()


def test_llamacpp_draft_model_reuses_the_shared_prefix() -> None:
    """The llama.cpp draft adapter: greedy continuation of a fake drafter; only new tokens are evaluated."""
    import numpy as np

    from specdecode.bench.llamacpp_draft import LlamaDraftLlama

    class FakeLlama:  # next token = last token + 1; EOS = 9
        def __init__(self) -> None:
            self.input_ids = np.zeros(64, dtype=np.intc)
            self.n_tokens = 0
            self.evaluated: list[list[int]] = []

        def eval(self, tokens: list[int]) -> None:
            self.evaluated.append(list(tokens))
            self.input_ids[self.n_tokens : self.n_tokens + len(tokens)] = tokens
            self.n_tokens += len(tokens)

    fake = FakeLlama()
    onehot = lambda llm: np.eye(10)[(llm.input_ids[llm.n_tokens - 1] + 1) % 10]
    draft = LlamaDraftLlama(fake, 3, stop={9}, last_logits=onehot)
    assert draft(np.array([1, 2, 3], dtype=np.intc)).tolist() == [4, 5, 6]
    assert fake.evaluated == [[1, 2, 3], [4], [5]]
    # the target accepted 4 and then chose 7: the drafter keeps 1..4 and evaluates only 7
    assert draft(np.array([1, 2, 3, 4, 7], dtype=np.intc)).tolist() == [8, 9]  # stops at EOS
    assert fake.evaluated[3:5] == [[7], [8]]
    # nothing new: the last token is evaluated again so that its logits are fresh
    fake.n_tokens = 3
    assert draft(np.array([1, 2, 3], dtype=np.intc)).tolist() == [4, 5, 6]
    assert fake.evaluated[5] == [3]


def test_resumed_run_probes_bandwidth_every_session(tiny_llama_dir: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The memory floor uses the median of the sessions' bandwidth probes, not the first one alone."""
    reads = iter([60.0, 30.0, 35.0])

    def probe(gigabytes: float) -> dict:
        return {"bytes": 1000, "repeats": 1, "threads": 1, "read_gb_per_s": next(reads), "copy_gb_per_s": 1.0}

    monkeypatch.setattr("specdecode.bench.harness.measure_bandwidth", probe)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS[:1]))
    out = tmp_path / "out"
    args = ["bench", "--model", str(tiny_llama_dir), "--methods", "plain", "--dataset", str(data),
            "--max-tokens", "4", "--dtype", "fp32", "--no-plots", "--no-progress", "--no-peak-rss-alone",
            "--out", str(out)]
    assert main(args) == 0
    assert json.loads((out / "summary.json").read_text())["bandwidth"]["read_gb_per_s"] == 60.0
    # a run stored before sessions kept their probes: its one probe is in the state's bandwidth only
    state = json.loads((out / "run-state.json").read_text())
    del state["sessions"][0]["bandwidth_probes"]
    (out / "run-state.json").write_text(json.dumps(state))
    assert main([*args, "--resume"]) == 0 and main([*args, "--resume"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["bandwidth"]["read_gb_per_s"] == 35.0
    assert summary["bandwidth"]["probes_read_gb_per_s"] == [60.0, 30.0, 35.0]
    assert "median of 3 probes (one per session and between rounds): 60.0, 30.0, 35.0 GB/s" in \
        (out / "summary.md").read_text()
    # Rounds: one more probe between each two.
    reads = iter([50.0, 20.0, 40.0])
    data.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS[:3]))
    rounds = [*args[:-1], str(tmp_path / "rounds"), "--round-size", "1"]
    assert main(rounds) == 0
    summary = json.loads((tmp_path / "rounds" / "summary.json").read_text())
    assert summary["bandwidth"]["probes_read_gb_per_s"] == [50.0, 20.0, 40.0]
    assert summary["bandwidth"]["read_gb_per_s"] == 40.0


FAKE_LLAMA_SERVER = '''#!PYTHON
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
spec = "--spec-type" in args
class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def _send(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        self._send({"status": "ok"})
    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert req["cache_prompt"] is False and req["temperature"] == 0.0
        out = [t + 1 for t in req["prompt"]][: req["n_predict"] - 1] + [2]
        self._send({"tokens": out, "stop_type": "eos", "spec": spec})
HTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def test_llama_server_peer_runs_one_server_per_method(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The llama-server peer with a stand-in binary: a server per method (plain, ngram-simple, draft with a GGUF
    draft), the prompt's ids in, the answer's ids out (the end token it stopped at included), its peak RSS kept."""
    import sys

    from specdecode.bench.peer_base import PeerContext
    from specdecode.bench.peers import make_peers

    ctx = PeerContext(target_path=tmp_path / "t.gguf", draft_path=tmp_path / "d.gguf", eos_token_id=2, max_tokens=8)
    monkeypatch.setenv("SPECDECODE_LLAMA_SERVER", str(tmp_path / "missing"))
    assert make_peers(["llama-server"], ctx) == ([], [
        "llama-server: skipped, no llama-server binary (benchmarks/build_llama_server.sh builds one; "
        "or set SPECDECODE_LLAMA_SERVER)"])
    binary = tmp_path / "llama-server"
    binary.write_text(FAKE_LLAMA_SERVER.replace("PYTHON", sys.executable))
    binary.chmod(0o755)
    for name in ("t.gguf", "d.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    monkeypatch.setenv("SPECDECODE_LLAMA_SERVER", str(binary))
    (peer,), notes = make_peers(["llamaserver"], ctx)
    assert notes == [] and peer.method_names() == ["llamaserver-plain", "llamaserver-ngram-simple",
                                                   "llamaserver-ngram-mod", "llamaserver-ngram-cache",
                                                   "llamaserver-draft"]
    try:
        methods = peer.open()
        for m in methods:
            assert m.prepare is not None
            m.prepare()
            assert m.generate([5, 6, 7]) == [6, 7, 8, 2]
            assert m.settings["server_peak_rss_bytes"] > 0
        assert methods[4].settings["args"] == f"-md {tmp_path / 'd.gguf'} --spec-type draft-simple"
    finally:
        peer.close()
    assert peer.proc is None
