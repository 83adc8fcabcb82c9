"""Ray Serve cluster, end to end: `python -m specdecode.cluster` with 2 SmolLM2-135M replicas (n-gram
speculation, one thread each) on loopback, driven by the official `openai` client.

* 16 concurrent requests (4 conversations x 4 requests, streamed and not) equal their single-process
  greedy references, every request of a conversation is served by one replica (the response header and
  the per-replica metrics of the merged /metrics agree).
* Killing one replica's process under a load of 16 requests: every request completes (equal to its
  reference) or gets a clear retriable error, none hangs, the survivor's requests are all intact, and
  Ray Serve brings the deployment back to 2 healthy replicas.
* SIGTERM stops the cluster and leaves no process of its Ray instance behind.

The conversations are picked, among candidates, by the same rendezvous hash the router uses, so that
each replica gets two of them whatever ids Ray gives the replicas: nothing depends on luck.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray.serve")
pytest.importorskip("openai")

import httpx  # noqa: E402
import psutil  # noqa: E402
from server_helpers import parse_prometheus  # noqa: E402

from specdecode.cluster.routing import rendezvous_order, routing_key  # noqa: E402

pytestmark = [pytest.mark.real]

ROOT = Path(__file__).resolve().parents[1]
SMOL = "smollm2-135m-instruct"
KEY = "sk-cluster-test"
MAX_TOKENS = 16
SYSTEM = "You are a concise assistant."
OPENERS = [f"Tell me one fact about the number {n}." for n in range(40)]
FOLLOW_UP = "Give an example."
START_TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    def __init__(self, log_path: Path) -> None:
        self.port = _free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = log_path.open("w")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               "RAY_USAGE_STATS_ENABLED": "0"}
        cmd = [sys.executable, "-m", "specdecode.cluster", "--model", SMOL, "--dtype", "fp32", "--max-model-len",
               "512", "--method", "ngram", "--replicas", "2", "--replica-threads", "1", "--max-num-seqs", "8",
               "--route-saturation", "64", "--api-key", KEY, "--port", str(self.port), "--log-level", "warning"]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.ready = threading.Event()
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if '"ready"' in line:
                self.ready.set()

    def wait_ready(self) -> Cluster:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.ready.wait(1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.log.flush()
                tail = Path(self.log.name).read_text()[-3000:]
                raise RuntimeError(f"the cluster did not start (rc {self.proc.poll()}):\n{tail}")
        return self

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {KEY}"}

    def replicas(self) -> list[dict[str, Any]]:
        return httpx.get(self.base_url + "/cluster/replicas", headers=self.headers, timeout=60).json()["replicas"]

    def metrics(self) -> dict[str, float]:
        return parse_prometheus(httpx.get(self.base_url + "/metrics", headers=self.headers, timeout=60).text)

    def openai(self) -> Any:
        from openai import OpenAI

        return OpenAI(base_url=self.base_url + "/v1", api_key=KEY, max_retries=0, timeout=180)

    def stop(self, timeout: float = 90) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("cluster") / "cluster.log")
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def ref_llm(cluster: Cluster) -> Iterator[Any]:  # loads while the cluster starts
    import torch

    from specdecode import LLM

    # One thread, as each replica has (module fixtures run before conftest's per-test one-thread fixture;
    # on a shared 2-core machine a second OpenMP thread makes the references several times slower).
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield LLM(SMOL, dtype="fp32", device="cpu", max_model_len=512)
    finally:
        torch.set_num_threads(prev)


def _conversation(opener: str, turn: int) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": opener}]
    if turn:
        messages += [{"role": "assistant", "content": "Sure."}, {"role": "user", "content": FOLLOW_UP}]
    return messages


@pytest.fixture(scope="module")
def workload(cluster: Cluster, ref_llm: Any) -> dict[str, Any]:
    """16 requests: 2 conversations per replica (by the router's own hash), 4 requests each (its first and
    second turn, each streamed and not), with their references."""
    from specdecode import SamplingParams

    cluster.wait_ready()
    ids = sorted(r["replica"] for r in cluster.replicas())
    assert len(ids) == 2, ids
    chosen: dict[str, list[str]] = {rid: [] for rid in ids}
    for opener in OPENERS:
        key = routing_key({"messages": _conversation(opener, 0)})
        home = rendezvous_order(key, ids, str)[0]
        if len(chosen[home]) < 2:
            chosen[home].append(opener)
    assert all(len(v) == 2 for v in chosen.values()), chosen
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    reqs = []
    for home, openers in chosen.items():
        for opener in openers:
            for turn in range(2):
                messages = _conversation(opener, turn)
                want = ref_llm.chat(messages, params)[0]
                for stream in (True, False):
                    reqs.append({"conv": opener, "home": home, "messages": messages, "stream": stream,
                                 "want": want})
    return {"ids": ids, "reqs": reqs}


def _one(cluster: Cluster, req: dict[str, Any], first_token: threading.Event | None = None,
         seen: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run one request; return text, finish reason, completion tokens, serving replica, or the error."""
    client = cluster.openai()
    common = dict(model=SMOL, messages=req["messages"], max_tokens=MAX_TOKENS, temperature=0)
    out: dict[str, Any] = {"replica": None}
    try:
        if req["stream"]:
            raw = client.chat.completions.with_raw_response.create(
                stream=True, stream_options={"include_usage": True}, **common)
            out["replica"] = raw.headers.get("x-specdecode-replica")
            text, finish, usage = "", [], None
            for chunk in raw.parse():
                if chunk.usage is not None:
                    usage = chunk.usage
                for choice in chunk.choices:
                    if choice.delta.content:
                        text += choice.delta.content
                        if seen is not None:
                            seen[id(req)] = out["replica"]
                        if first_token is not None:
                            first_token.set()
                    if choice.finish_reason:
                        finish.append(choice.finish_reason)
            out.update(text=text, finish=finish, tokens=usage.completion_tokens if usage else None)
        else:
            raw = client.chat.completions.with_raw_response.create(**common)
            out["replica"] = raw.headers.get("x-specdecode-replica")
            resp = raw.parse()
            out.update(text=resp.choices[0].message.content, finish=[resp.choices[0].finish_reason],
                       tokens=resp.usage.completion_tokens)
    except Exception as exc:  # noqa: BLE001 - the fault test classifies errors
        out["error"] = exc
    finally:
        client.close()
    return out


def _run_all(cluster: Cluster, reqs: list[dict[str, Any]], **kw: Any) -> list[dict[str, Any]]:
    barrier = threading.Barrier(len(reqs))

    def run(req: dict[str, Any]) -> dict[str, Any]:
        barrier.wait(60)
        return _one(cluster, req, **kw)

    with ThreadPoolExecutor(len(reqs)) as pool:
        futures = [pool.submit(run, r) for r in reqs]
        return [f.result(timeout=400) for f in futures]  # a hung request fails here


def _assert_equal_reference(req: dict[str, Any], got: dict[str, Any]) -> None:
    want = req["want"]
    assert "error" not in got, f"{req['conv']!r}: {got.get('error')!r}"
    assert got["text"] == want.text, req["messages"]
    assert got["finish"] == [want.finish_reason]
    assert got["tokens"] == len(want.token_ids)


def _per_replica(m: dict[str, float], name: str, rid: str) -> float:
    return sum(v for k, v in m.items() if k.startswith(name + "{") and f'replica="{rid}"' in k)


def test_sixteen_concurrent_requests_equal_references_and_stay_with_their_replica(
        cluster: Cluster, workload: dict[str, Any]) -> None:
    reqs = workload["reqs"]
    results = _run_all(cluster, reqs)
    for req, got in zip(reqs, results, strict=True):
        _assert_equal_reference(req, got)
        assert got["replica"] == req["home"], f"{req['conv']!r} went to {got['replica']}, not {req['home']}"
    m = cluster.metrics()
    for rid in workload["ids"]:
        mine = [got for req, got in zip(reqs, results, strict=True) if req["home"] == rid]
        assert len(mine) == 8
        assert _per_replica(m, "specdecode_requests_finished_total", rid) == 8
        assert _per_replica(m, "specdecode_generation_tokens_total", rid) == sum(g["tokens"] for g in mine)
        assert m[f'specdecode_cluster_routed_total{{replica="{rid}",route="affinity"}}'] == 8
        assert f'specdecode_spec_decode_num_draft_tokens_total{{replica="{rid}"}}' in m  # speculation metrics too
        assert m[f'specdecode_cluster_inflight{{replica="{rid}"}}'] == 0
        assert _per_replica(m, "specdecode_requests_running", rid) == 0
    assert not any("fallback" in k for k in m)
    assert m["specdecode_cluster_replicas"] == 2


def test_client_disconnect_aborts_the_request_on_its_replica(cluster: Cluster) -> None:
    aborted = "specdecode_requests_finished_total"
    before = cluster.metrics()
    body = {"model": SMOL, "messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": 400,
            "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=cluster.base_url, headers=cluster.headers, timeout=120) as client:
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            replica = r.headers["x-specdecode-replica"]
            got = [line for line, _ in zip(r.iter_lines(), range(6), strict=False) if line.startswith("data: ")]
            assert len(got) >= 2
        # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 60
    while True:
        m = cluster.metrics()
        running = _per_replica(m, "specdecode_requests_running", replica)
        done = m.get(f'{aborted}{{finish_reason="abort",replica="{replica}"}}', 0) - before.get(
            f'{aborted}{{finish_reason="abort",replica="{replica}"}}', 0)
        if running == 0 and done == 1:
            break
        assert time.monotonic() < deadline, f"not aborted: running {running}, aborts {done}"
        time.sleep(0.5)
    made = _per_replica(m, "specdecode_generation_tokens_total", replica) - _per_replica(
        before, "specdecode_generation_tokens_total", replica)
    assert made < 400


def test_killed_replica_is_replaced_and_no_request_hangs(cluster: Cluster, workload: dict[str, Any]) -> None:
    reqs = workload["reqs"]
    replicas = {r["replica"]: r for r in cluster.replicas()}
    victim, survivor = workload["ids"]
    before = cluster.metrics()
    streamed: dict[int, str] = {}
    victim_streaming = threading.Event()

    def watch() -> None:  # kill the victim once one of its streams has shown a token
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if victim in streamed.values():
                os.kill(replicas[victim]["pid"], signal.SIGKILL)
                victim_streaming.set()
                return
            time.sleep(0.02)

    killer = threading.Thread(target=watch, daemon=True)
    killer.start()
    results = _run_all(cluster, reqs, seen=streamed)
    killer.join(5)
    assert victim_streaming.is_set(), "no stream of the victim showed a token"
    errors = 0
    for req, got in zip(reqs, results, strict=True):
        if req["home"] == survivor:  # nothing of the other replica's requests is lost
            _assert_equal_reference(req, got)
            assert got["replica"] == survivor
        elif "error" in got:  # a stream that had shown output when its replica died
            errors += 1
            assert req["stream"] and got["replica"] == victim
            message = str(got["error"])
            assert "failed after it had sent output" in message and "retry the request" in message, message
        else:  # finished before the kill, or retried on the survivor
            _assert_equal_reference(req, got)
    assert errors >= 1  # the stream that triggered the kill
    after = cluster.metrics()
    retried = after["specdecode_cluster_retries_total"] - before["specdecode_cluster_retries_total"]
    failed = after["specdecode_cluster_stream_failures_total"] - before["specdecode_cluster_stream_failures_total"]
    # The victim's unstreamed requests (its non-streamed ones at least) were retried on the survivor.
    assert failed == errors and retried >= 1
    # Ray Serve replaces the dead replica: 2 healthy replicas again, the victim gone.
    deadline = time.monotonic() + 240
    while True:
        now = cluster.replicas()
        ids = {r["replica"] for r in now if r["healthy"]}
        if len(ids) == 2 and victim not in ids:
            break
        assert time.monotonic() < deadline, f"not back to 2 healthy replicas: {now}"
        time.sleep(2)
    assert survivor in ids
    # ... and the cluster serves again, exactly.
    got = _one(cluster, reqs[0])
    _assert_equal_reference(reqs[0], got)


def test_sigterm_stops_the_cluster_and_leaves_no_ray_process(cluster: Cluster) -> None:
    cluster.wait_ready()
    family = psutil.Process(cluster.proc.pid).children(recursive=True)
    assert any("raylet" in " ".join(p.cmdline()) for p in family if p.is_running())
    t0 = time.monotonic()
    rc = cluster.stop(timeout=120)
    assert rc == 0, rc
    deadline = time.monotonic() + 60
    while True:
        alive = []
        for p in family:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(f"{p.pid} {p.name()}")
            except psutil.NoSuchProcess:
                pass
        if not alive:
            break
        assert time.monotonic() < deadline, f"Ray processes left after SIGTERM: {alive}"
        time.sleep(0.5)
    print(json.dumps({"shutdown_s": round(time.monotonic() - t0, 1)}))
