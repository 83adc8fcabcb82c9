"""Process-wide state that the request router shares with the ingress of the same process.

Ray Serve pickles a request router's module *by value*, so the router keeps no state of its own at
module level: it writes here (a module pickled by reference, hence the one the ingress imports).
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge

ROUTER_REGISTRY = CollectorRegistry(auto_describe=True)
ROUTED = Counter("specdecode_cluster_routed", "Requests routed by the ingress, by replica and by route (affinity: "
                 "the key's replica; fallback: another one, the key's replica being saturated or avoided; "
                 "any: no key).", ["replica", "route"], registry=ROUTER_REGISTRY)
INFLIGHT = Gauge("specdecode_cluster_inflight", "Requests the ingress's router has in flight on each replica (what "
                 "it compares with the routing saturation).", ["replica"], registry=ROUTER_REGISTRY)

_lock = threading.Lock()
_inflight: dict[str, int] = {}
_live: dict[str, set[str]] = {}


def record_replicas(deployment: str, replica_ids: set[str]) -> None:
    with _lock:
        _live[deployment] = set(replica_ids)


def live_replicas(deployment: str) -> set[str]:
    """Routable replica ids of a deployment, as the routers of this process last saw them."""
    with _lock:
        return set(_live.get(deployment, ()))


def count_routed(replica: str, route: str) -> None:
    ROUTED.labels(replica=replica, route=route).inc()


def set_inflight(replica: str, count: int | None) -> None:
    """Publish the router's in-flight count of a replica (None: the replica is gone)."""
    with _lock:
        if count is None:
            _inflight.pop(replica, None)
            try:
                INFLIGHT.remove(replica)
            except KeyError:
                pass
        else:
            _inflight[replica] = count
            INFLIGHT.labels(replica=replica).set(count)


def inflight() -> dict[str, int]:
    with _lock:
        return dict(_inflight)
