"""PrefixAffinityRouter inside a real (local) Ray Serve, on two model-free replicas: keys stick to their
rendezvous-hash replica, a saturated replica's key falls back to the other one, `avoid` and `target`
are honoured. Cheap: no model, 0-CPU replicas; one local Ray instance for the module, shut down after.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("ray.serve")

from specdecode.cluster.routing import rendezvous_order, routing_key  # noqa: E402

APP = "routertest"
DEPLOYMENT = "Echo"


def _echo_app() -> Any:
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from specdecode.cluster.deployment import ROUTER_PATH

    # Defined here, not at module level: Ray pickles a local class by value (workers cannot import tests/).
    @serve.deployment(name=DEPLOYMENT, num_replicas=2, max_ongoing_requests=8, ray_actor_options={"num_cpus": 0},
                      request_router_config=RequestRouterConfig(request_router_class=ROUTER_PATH,
                                                                request_router_kwargs={"saturation": 2}))
    class Echo:
        def __init__(self) -> None:
            self.rid = serve.get_replica_context().replica_id.unique_id

        async def who(self, delay: float = 0.0, **routing: Any) -> str:
            await asyncio.sleep(delay)
            return self.rid

        async def stream(self, n: int, **routing: Any) -> Any:
            for _ in range(n):
                yield self.rid

    return Echo.bind()


@pytest.fixture(scope="module")
def echo() -> Iterator[Any]:
    import ray
    from ray import serve

    ray.init(address="local", num_cpus=2, object_store_memory=200 << 20, include_dashboard=False,
             log_to_driver=False, configure_logging=False)
    try:
        handle = serve.run(_echo_app(), name=APP, route_prefix=None)
        yield handle
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def _ids(handle: Any) -> list[str]:
    from specdecode.cluster.registry import live_replicas

    handle.who.remote().result(timeout_s=60)  # the handle's router starts with its first call
    deadline = time.monotonic() + 30
    while len(live_replicas(DEPLOYMENT)) < 2:
        assert time.monotonic() < deadline, live_replicas(DEPLOYMENT)
        time.sleep(0.1)
    return sorted(live_replicas(DEPLOYMENT))


def _settled(timeout: float = 10.0) -> None:
    """Wait until the router has counted out every finished call (its completion callbacks may lag the
    results a little), so that the next call sees the replicas idle."""
    from specdecode.cluster.registry import inflight

    deadline = time.monotonic() + timeout
    while any(inflight().values()):
        assert time.monotonic() < deadline, inflight()
        time.sleep(0.01)


def _who(echo: Any, **kw: Any) -> str:
    _settled()
    return echo.who.remote(**kw).result(timeout_s=30)


def test_keys_stick_to_their_replica_and_fall_back_when_it_is_saturated(echo: Any) -> None:
    ids = _ids(echo)
    keys = [routing_key({"messages": [{"role": "user", "content": f"conversation {i}"}]}) for i in range(8)]
    for key in keys:
        home = rendezvous_order(key, ids, str)[0]
        assert [_who(echo, route_key=key) for _ in range(3)] == [home] * 3
    assert {rendezvous_order(k, ids, str)[0] for k in keys} == set(ids)  # both replicas got keys

    key = keys[0]
    home = rendezvous_order(key, ids, str)[0]
    other = next(r for r in ids if r != home)
    _settled()
    busy = [echo.who.remote(delay=4.0, route_key=key) for _ in range(2)]  # hold its replica at saturation ...
    from specdecode.cluster.registry import inflight

    deadline = time.monotonic() + 3
    while inflight().get(home, 0) < 2:
        assert time.monotonic() < deadline, inflight()
        time.sleep(0.01)
    assert echo.who.remote(route_key=key).result(timeout_s=30) == other  # ... so the key falls back
    assert [b.result(timeout_s=30) for b in busy] == [home, home]
    assert _who(echo, route_key=key) == home  # and returns once it is free
    assert _who(echo, route_key=key, avoid=home) == other
    # Finished streams are counted out too: a key's streams keep going to its replica.
    for _ in range(4):
        _settled()
        assert list(echo.options(stream=True).stream.remote(3, route_key=key)) == [home] * 3
    for rid in ids:
        assert _who(echo, target=rid) == rid
