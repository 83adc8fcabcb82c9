"""The cluster's routing, metrics merge and CLI wiring, without Ray (fast, no model)."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from specdecode.cluster.config import ClusterConfig
from specdecode.cluster.routing import carries_output, rank_replicas, rendezvous_order, routing_key

ROOT = Path(__file__).resolve().parents[1]
IDS = [f"r{i}" for i in range(4)]


def _chat(*messages: tuple[str, str], **extra: object) -> dict:
    return {"model": "m", "messages": [{"role": r, "content": c} for r, c in messages], **extra}


def test_routing_key_is_stable_across_the_turns_of_one_conversation() -> None:
    turn1 = _chat(("system", "be brief"), ("user", "what is a monad?"))
    turn2 = _chat(("system", "be brief"), ("user", "what is a monad?"), ("assistant", "a monoid in ..."),
                  ("user", "and a functor?"), stream=True, max_tokens=9)
    other = _chat(("system", "be brief"), ("user", "what is a group?"))
    assert routing_key(turn1) == routing_key(turn2) is not None
    assert routing_key(other) != routing_key(turn1)
    # Content parts and plain strings give the same key.
    parts = {"messages": [{"role": "system", "content": [{"type": "text", "text": "be brief"}]},
                          {"role": "user", "content": "what is a monad?"}]}
    assert routing_key(parts) == routing_key(turn1)


def test_routing_key_session_header_then_user_then_prompt_prefix() -> None:
    body = _chat(("user", "hello"), user="alice")
    assert routing_key(body, {"x-session-id": "s1"}) == routing_key({"prompt": "x"}, {"x-session-id": "s1"})
    assert routing_key(body) == routing_key(_chat(("user", "bye"), user="alice"))
    assert routing_key({"prompt": "a" * 50 + "tail one"}, prefix_chars=50) == routing_key(
        {"prompt": "a" * 50 + "tail two"}, prefix_chars=50)
    assert routing_key({"prompt": [1, 2, 3, 4]}, prefix_chars=3) == routing_key({"prompt": [[1, 2, 3, 5]]},
                                                                                 prefix_chars=3)
    assert routing_key({"prompt": "x"}) != routing_key({"prompt": [120]})
    for body in (None, [], "text", {}, {"prompt": ""}, {"messages": []}, {"messages": "x"}):
        assert routing_key(body) is None


def test_rendezvous_moves_only_the_keys_of_a_removed_replica() -> None:
    keys = [routing_key({"prompt": f"conversation {i}"}) for i in range(400)]
    before = {k: rendezvous_order(k, IDS, str)[0] for k in keys}
    spread = Counter(before.values())
    assert set(spread) == set(IDS) and min(spread.values()) > 50  # about 100 each
    after = {k: rendezvous_order(k, IDS[:3], str)[0] for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == "r3" for k in moved)
    assert rendezvous_order(keys[0], list(reversed(IDS)), str) == rendezvous_order(keys[0], IDS, str)


def test_rank_replicas_falls_back_when_the_keys_replica_is_saturated() -> None:
    key = routing_key({"prompt": "hello"})
    primary = rendezvous_order(key, IDS, str)[0]
    others = [r for r in IDS if r != primary]
    loads = {r: 0 for r in IDS}
    assert rank_replicas(key, IDS, str, loads.get, saturation=4)[0] == [primary]
    loads[primary] = 4
    ranks = rank_replicas(key, IDS, str, loads.get, saturation=4)
    assert sorted(ranks[0]) == sorted(others) and ranks[-1] == [primary]
    loads[primary] = None  # unknown load: try it
    assert rank_replicas(key, IDS, str, loads.get, saturation=4)[0] == [primary]
    # A replica that failed the request is tried last, and only then.
    ranks = rank_replicas(key, IDS, str, lambda r: 0, saturation=4, avoid=primary)
    assert primary not in ranks[0] and ranks[-1] == [primary]
    assert rank_replicas(key, ["r0"], str, lambda r: 0, 4, avoid="r0") == [["r0"]]
    assert rank_replicas(None, IDS, str, lambda r: 0, 4) == [IDS]
    assert rank_replicas(key, [], str, lambda r: 0, 4) == []


def test_carries_output() -> None:
    opening = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n'
    token = b'data: {"choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}]}\n\n'
    text = b'data: {"choices":[{"index":0,"text":"x","finish_reason":null}]}\n\n'
    empty_text = b'data: {"choices":[{"index":0,"text":"","finish_reason":null}]}\n\n'
    finish = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}\n\n'
    assert not carries_output(opening) and not carries_output(empty_text)
    assert carries_output(token) and carries_output(text) and carries_output(finish)
    assert carries_output(opening + token)
    assert carries_output(b'data: {"error": {"message": "x"}}\n\n') and carries_output(b"data: [DONE]\n\n")
    assert carries_output(b'{"id": "cmpl-1"}')  # not SSE: a whole JSON body


def test_merge_metrics_labels_every_sample_by_replica() -> None:
    from server_helpers import parse_prometheus

    from specdecode.cluster.merge import merge_metrics
    from specdecode.server.metrics import ServerMetrics

    a, b = ServerMetrics(), ServerMetrics()
    a.generation_tokens.inc(5)
    b.generation_tokens.inc(7)
    b.requests_finished.labels(finish_reason="stop").inc()
    a.step_seconds.observe(0.01)
    text = merge_metrics({"ra": a.render().decode(), "rb": b.render().decode()},
                         extra="# TYPE specdecode_cluster_x counter\nspecdecode_cluster_x_total 3.0\n").decode()
    m = parse_prometheus(text)
    assert m['specdecode_generation_tokens_total{replica="ra"}'] == 5
    assert m['specdecode_generation_tokens_total{replica="rb"}'] == 7
    assert m['specdecode_requests_finished_total{finish_reason="stop",replica="rb"}'] == 1
    assert m['specdecode_step_seconds_count{replica="ra"}'] == 1
    assert m["specdecode_cluster_x_total"] == 3
    assert text.count("# TYPE specdecode_generation_tokens_total counter") == 1


def test_cluster_config_checks_and_autoscaling_defaults() -> None:
    cfg = ClusterConfig(model="m", replicas=2, min_replicas=1, max_replicas=4, max_num_seqs=8, max_waiting=16)
    assert cfg.autoscaling and cfg.replicas == 2 and cfg.saturation == 8 and cfg.max_ongoing_requests == 24
    assert ClusterConfig(model="m", replicas=3, max_replicas=5).min_replicas == 3
    assert ClusterConfig(model="m", replicas=9, min_replicas=1, max_replicas=2).replicas == 2
    for bad in ({"replicas": 0}, {"replica_threads": 0}, {"min_replicas": 3, "max_replicas": 2},
                {"replica_gpus": -1.0}):
        with pytest.raises(ValueError):
            ClusterConfig(model="m", **bad)  # type: ignore[arg-type]


def test_serve_cli_takes_the_cluster_flags_and_the_core_import_needs_no_ray() -> None:
    from specdecode.cli import build_parser
    from specdecode.cluster.cli import config_from_args, wants_cluster

    args = build_parser().parse_args(["serve", "--model", "m", "--replicas", "2", "--replica-threads", "2",
                                      "--replica-gpus", "0.5", "--min-replicas", "1", "--max-replicas", "3",
                                      "--method", "ngram"])
    assert wants_cluster(args)
    cfg = config_from_args(args)
    assert (cfg.replicas, cfg.min_replicas, cfg.max_replicas, cfg.replica_threads, cfg.replica_gpus) == (
        2, 1, 3, 2, 0.5)
    assert cfg.speculative_config == {"method": "ngram"}
    assert (cfg.enable_prefix_caching, cfg.prefix_cache_gb, cfg.max_num_batched_tokens) == (True, 1.0, 256)
    cached = config_from_args(build_parser().parse_args(["serve", "--model", "m", "--replicas", "2",
                                                         "--no-prefix-caching", "--prefix-cache-gb", "0.5",
                                                         "--max-num-batched-tokens", "0"]))
    assert (cached.enable_prefix_caching, cached.prefix_cache_gb, cached.max_num_batched_tokens) == (False, 0.5, 0)
    assert not wants_cluster(build_parser().parse_args(["serve", "--model", "m"]))
    # Importing the engine, the server and the cluster's plain modules loads no Ray.
    code = ("import sys, specdecode, specdecode.cli, specdecode.server.app, specdecode.cluster, "
            "specdecode.cluster.cli, specdecode.cluster.routing; "
            "from specdecode.cli import build_parser; build_parser(); "
            "assert 'ray' not in sys.modules, 'ray imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120,
                   env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


def test_serve_app_builder_converts_string_args() -> None:
    from specdecode.cluster.serve_app import config_from_dict

    cfg = config_from_dict({"model": "m", "replicas": "2", "replica_gpus": "0.5", "max_model_len": "none",
                            "speculative_config": '{"method": "ngram"}', "min_replicas": 1, "max_replicas": "3"})
    assert (cfg.replicas, cfg.replica_gpus, cfg.max_model_len, cfg.max_replicas) == (2, 0.5, None, 3)
    assert cfg.speculative_config == {"method": "ngram"}
    with pytest.raises(ValueError, match="unknown cluster options"):
        config_from_dict({"model": "m", "replica": 2})


def test_application_carries_the_replica_resources_router_and_autoscaling() -> None:
    pytest.importorskip("ray.serve")
    from specdecode.cluster.deployment import ENGINE_DEPLOYMENT, ROUTER_PATH, build_application

    cfg = ClusterConfig(model="m", replicas=2, min_replicas=1, max_replicas=4, replica_threads=2, replica_gpus=0.5,
                        max_num_seqs=4, max_waiting=12, route_saturation=3)
    app = build_application(cfg)
    engine = app._bound_deployment.init_args[0]._bound_deployment  # the ingress is bound to the engine
    assert engine.name == ENGINE_DEPLOYMENT
    assert engine.ray_actor_options["num_cpus"] == 2 and engine.ray_actor_options["num_gpus"] == 0.5
    dc = engine._deployment_config
    assert dc.max_ongoing_requests == 16
    auto = dc.autoscaling_config
    assert (auto.min_replicas, auto.max_replicas, auto.initial_replicas, auto.target_ongoing_requests) == (1, 4, 2, 4)
    assert dc.request_router_config.request_router_class == ROUTER_PATH
    assert dc.request_router_config.request_router_kwargs == {"saturation": 3}
    fixed = build_application(ClusterConfig(model="m", replicas=3))._bound_deployment.init_args[0]._bound_deployment
    assert fixed.num_replicas == 3 and fixed._deployment_config.autoscaling_config is None


def test_specdecode_serve_with_replicas_runs_the_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    import specdecode.cluster.cli as cluster_cli
    from specdecode.cli import main

    seen = {}

    def fake_run_cluster(args: object) -> int:
        seen["cfg"] = cluster_cli.config_from_args(args)  # type: ignore[arg-type]
        return 0

    monkeypatch.setattr(cluster_cli, "run_cluster", fake_run_cluster)
    assert main(["serve", "--model", "m", "--replicas", "2", "--ray-address", "auto"]) == 0
    assert seen["cfg"].replicas == 2
    assert main(["serve", "--model", "m", "--replicas", "0"]) == 2  # a ValueError: a message, not a traceback


# ---- back-pressure and the body limit at the ingress (no Ray started) ---------------------------------------------


class _Stream:
    """What `handle.options(stream=True).handle.remote(...)` gives the ingress: the replica's ASGI messages."""

    def __init__(self, messages: list[dict], error: Exception | None) -> None:
        self.messages, self.error, self.cancelled = list(messages), error, False

    def __aiter__(self) -> _Stream:
        return self

    async def __anext__(self) -> dict:
        if self.error is not None:
            raise self.error
        if not self.messages:
            raise StopAsyncIteration
        return self.messages.pop(0)

    def cancel(self) -> None:
        self.cancelled = True


class _Handle:
    """A DeploymentHandle of the engine deployment, answering every call with `messages` or raising `error`."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error, self.calls = error, []
        self.handle = self

    def options(self, **kwargs: object) -> _Handle:
        return self

    def remote(self, request: dict, **routing: object) -> _Stream:
        self.calls.append(request)
        body = b'{"id": "cmpl-1"}'
        return _Stream([{"type": "replica", "replica": "r0"},
                        {"type": "http.response.start", "status": 200,
                         "headers": [(b"content-type", b"application/json")]},
                        {"type": "http.response.body", "body": body, "more_body": False}], self.error)


def _ingress_call(handle: _Handle, chunks: list[bytes], headers: list[tuple[bytes, bytes]] | None = None,
                  **config: object) -> tuple[int, dict, bytes, int]:
    """POST /v1/completions through the ingress's app, its body sent in `chunks`: (status, headers, body, chunks
    read)."""
    import asyncio

    from specdecode.cluster.deployment import Ingress

    ingress = Ingress.__wrapped__(handle, ClusterConfig(model="m", **config).to_dict())  # the class, unwrapped
    app = ingress.__serve_build_asgi_app__()
    pending = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    read, sent = 0, []

    async def receive() -> dict:
        nonlocal read
        if not pending:
            await asyncio.Event().wait()
        read += 1
        return pending.pop(0)

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "root_path": "", "query_string": b"",
             "headers": headers or [], "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, body, read


def test_ingress_answers_ray_back_pressure_with_429() -> None:
    pytest.importorskip("ray.serve")
    import json

    from ray.serve.exceptions import BackPressureError

    handle = _Handle(BackPressureError(num_queued_requests=4, max_queued_requests=4))
    status, headers, body, _ = _ingress_call(handle, [b'{"prompt": "hi"}'])
    assert status == 429 and headers["retry-after"] == "1", body
    err = json.loads(body)["error"]
    assert err["code"] == "rate_limit_exceeded" and err["type"] == "rate_limit_error"
    assert "max_queued_requests=4" in err["message"]
    assert len(handle.calls) == 1  # no retry on another replica: the queue for all of them is full
    status, _, body, _ = _ingress_call(_Handle(), [b'{"prompt": "hi"}'])
    assert status == 200 and body == b'{"id": "cmpl-1"}'


def test_ingress_caps_chunked_and_declared_bodies_like_the_server() -> None:
    pytest.importorskip("ray.serve")
    limit = 1000
    handle = _Handle()
    # Chunked (no Content-Length): refused once past the limit, the rest never read, nothing forwarded.
    status, _, body, read = _ingress_call(handle, [b"x" * 400] * 10, max_body_bytes=limit)
    assert status == 413 and b"request body larger than 1000 bytes" in body
    assert read == 3 and not handle.calls
    # A declared length over the limit: refused before the body is forwarded.
    chunk = b"x" * (limit + 1)
    status, _, _, _ = _ingress_call(handle, [chunk], [(b"content-length", str(len(chunk)).encode())],
                                    max_body_bytes=limit)
    assert status == 413 and not handle.calls
    # Within the limit, chunked: forwarded whole.
    status, _, _, _ = _ingress_call(handle, [b'{"prompt": ', b'"hi"}'], max_body_bytes=limit)
    assert status == 200 and handle.calls[0]["body"] == b'{"prompt": "hi"}'


def test_deployments_bound_their_queues() -> None:
    pytest.importorskip("ray.serve")
    from specdecode.cluster.deployment import INGRESS_QUEUE, build_application

    app = build_application(ClusterConfig(model="m", replicas=2, max_waiting=12))
    ingress = app._bound_deployment
    engine = ingress.init_args[0]._bound_deployment
    assert engine._deployment_config.max_queued_requests == 12  # default: one replica's queue
    assert ingress._deployment_config.max_queued_requests == INGRESS_QUEUE  # bursts only: it just forwards
    back = ingress._deployment_config.backpressure_config
    assert back.status_code == 429 and back.retry_after_s == 1
    app = build_application(ClusterConfig(model="m", max_queued_requests=5))
    assert app._bound_deployment.init_args[0]._bound_deployment._deployment_config.max_queued_requests == 5


def test_max_queued_requests_flag_and_check() -> None:
    from specdecode.cli import build_parser
    from specdecode.cluster.cli import config_from_args

    args = build_parser().parse_args(["serve", "--model", "m", "--replicas", "2", "--max-queued-requests", "7"])
    assert config_from_args(args).queued_requests == 7
    with pytest.raises(ValueError, match="--max-queued-requests"):
        ClusterConfig(model="m", max_queued_requests=0)


def test_a_local_ray_binds_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    import types

    from specdecode.cluster.cli import LOCAL_RAY_ENV, ClusterServer

    seen: dict = {}
    ray = types.ModuleType("ray")
    ray.serve = types.ModuleType("ray.serve")  # type: ignore[attr-defined]
    ray.init = lambda **kw: seen.update(kw, env={k: os.environ.get(k) for k in LOCAL_RAY_ENV})  # type: ignore
    monkeypatch.setitem(sys.modules, "ray", ray)
    monkeypatch.setitem(sys.modules, "ray.serve", ray.serve)
    for key in LOCAL_RAY_ENV:
        monkeypatch.setenv(key, "unset by the test")  # monkeypatch puts the original back afterwards
    ClusterServer(ClusterConfig(model="m")).start_ray()
    assert seen["address"] == "local" and seen["env"] == LOCAL_RAY_ENV
    assert seen["_node_ip_address"] == "127.0.0.1" and seen["include_dashboard"] is False
    assert seen["dashboard_host"] == "127.0.0.1"
    for key in LOCAL_RAY_ENV:
        monkeypatch.setenv(key, "theirs")
    seen.clear()
    ClusterServer(ClusterConfig(model="m"), ray_address="auto").start_ray()  # joining: their cluster, their setup
    assert seen["address"] == "auto" and set(seen["env"].values()) == {"theirs"}
