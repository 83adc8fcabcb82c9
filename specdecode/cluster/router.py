"""`PrefixAffinityRouter`: the Ray Serve request router of the engine deployment (imports Ray).

Why a request router, and not the alternatives:

* Multiplexed model ids (`handle.options(multiplexed_model_id=key)`) are a cache hint: a key goes to a
  replica that "has it loaded", else to any replica, and a replica forgets keys beyond
  `max_num_models_per_replica`; nothing keeps one conversation on one replica.
* N single-replica deployments pin exactly, but leave replacement of dead replicas, autoscaling and
  load balancing to home-made code.
* A `RequestRouter` subclass runs inside the caller's DeploymentHandle, sees the replica set that Ray
  Serve keeps current (replacements, autoscaled replicas) and each replica's queue length, and
  returns ranked candidates; Ray Serve sends the request to the least loaded replica with room in the
  first rank that has one. Routing is matched by request id (this router does not use `FIFOMixin`,
  which may hand a chosen replica to a different queued request), so the rank computed for a request
  is the rank it is routed by. (Calls made from within one request share Ray's internal request id,
  so one request must not have two calls being routed at once: the ingress makes its calls one by one.)

The key arrives as the `route_key` keyword of the call; `avoid` names a replica that just failed the
request (the retry goes elsewhere), `target` asks for one replica by id (the merged /metrics).
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from specdecode.cluster import registry
from specdecode.cluster.routing import rank_replicas, rendezvous_order


class PrefixAffinityRouter(RequestRouter):
    """Rendezvous hashing of `route_key` onto the replicas, with a load-aware fallback."""

    def initialize_state(self, saturation: int = 8, **kwargs: Any) -> None:
        self.saturation = saturation
        self._primary: dict[str, str] = {}
        # Requests in flight that this router sent, per replica; keyed by (replica, request id) to count each
        # completion once.
        self._inflight: dict[str, int] = {}
        self._sent: dict[tuple[str, str], int] = {}

    def _load(self, replica: RunningReplica) -> int:
        """Requests this router has in flight on `replica`. Not Ray Serve's queue-length cache: replicas'
        replies may land after the completion that they predate and leave it a request or two high for
        seconds, which would send an idle conversation's request away from its replica. (With several
        ingress replicas each counts its own requests; Ray Serve's own max_ongoing_requests check still
        guards the hard limit.)"""
        return self._inflight.get(replica.replica_id.unique_id, 0)

    def _record(self) -> None:
        registry.record_replicas(self._deployment_id.name, {r.unique_id for r in self._replica_id_set})

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._record()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        kwargs = pending_request.kwargs if pending_request is not None else {}
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # back off between rounds, never spin
        target = kwargs.get("target")
        if target is not None:
            return [[r for r in candidate_replicas if r.replica_id.unique_id == target]]
        key = kwargs.get("route_key")
        ranks = rank_replicas(key, candidate_replicas, lambda r: r.replica_id.unique_id, self._load, self.saturation,
                              kwargs.get("avoid"))
        if key is not None and pending_request is not None:
            if len(self._primary) > 10_000:  # requests cancelled before routing leave entries behind
                self._primary.clear()
            order = rendezvous_order(key, candidate_replicas, lambda r: r.replica_id.unique_id)
            self._primary[pending_request.metadata.internal_request_id] = order[0].replica_id.unique_id \
                if order else ""
        return ranks

    def on_request_routed(self, pending_request: PendingRequest, replica_id: Any, result: Any) -> None:
        kwargs = pending_request.kwargs or {}
        if kwargs.get("target") is not None:
            return  # the ingress's own calls (health, metrics): not requests
        rid = replica_id.unique_id
        sent = (rid, pending_request.metadata.internal_request_id)
        self._sent[sent] = self._sent.get(sent, 0) + 1
        self._inflight[rid] = self._inflight.get(rid, 0) + 1
        registry.set_inflight(rid, self._inflight[rid])
        primary = self._primary.pop(pending_request.metadata.internal_request_id, None)
        if kwargs.get("route_key") is None:
            route = "any"
        else:
            route = "affinity" if primary == replica_id.unique_id and not kwargs.get("avoid") else "fallback"
        registry.count_routed(replica_id.unique_id, route)

    def on_request_completed(self, replica_id: Any, internal_request_id: str) -> None:
        rid = replica_id.unique_id
        sent = (rid, internal_request_id)
        left = self._sent.get(sent, 0)
        if not left:
            return  # never counted (rejected by the replica, or sent before this router counted)
        if left == 1:
            del self._sent[sent]
        else:
            self._sent[sent] = left - 1
        self._inflight[rid] = max(0, self._inflight.get(rid, 0) - 1)
        registry.set_inflight(rid, self._inflight[rid])

    def on_replica_actor_died(self, replica_id: Any) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id.unique_id)
        self._record()

    def _forget(self, rid: str) -> None:
        self._inflight.pop(rid, None)
        registry.set_inflight(rid, None)
        for sent in [k for k in self._sent if k[0] == rid]:
            del self._sent[sent]
