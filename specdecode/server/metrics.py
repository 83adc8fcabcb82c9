"""Prometheus metrics of the server, all named ``specdecode_*``, in a registry of their own.

One ``ServerMetrics`` per app, so several servers in one process (tests) never collide in
prometheus_client's global registry. The engine thread updates them; ``/metrics`` renders them.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from specdecode.metrics import SpecStats

STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    """Every metric the server exports (docs/serving.md says what each means)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests_running = Gauge(
            "specdecode_requests_running", "Requests in the running batch (holding a KV cache row).", registry=r)
        self.requests_waiting = Gauge(
            "specdecode_requests_waiting", "Requests admitted to the queue, waiting for a free row.", registry=r)
        self.kv_cache_usage = Gauge(
            "specdecode_kv_cache_usage", "Fraction of the KV cache slots (rows x context) holding live tokens.",
            registry=r)
        self.prompt_tokens = Counter(
            "specdecode_prompt_tokens", "Prompt tokens of admitted requests.", registry=r)
        self.generation_tokens = Counter(
            "specdecode_generation_tokens", "Output tokens generated (aborted requests included).", registry=r)
        self.engine_steps = Counter(
            "specdecode_engine_steps", "Batch steps run (one target forward over the whole batch each).", registry=r)
        self.step_seconds = Histogram(
            "specdecode_step_seconds", "Wall time of one batch step (admission prefills + draft + verify).",
            buckets=STEP_BUCKETS, registry=r)
        self.spec_drafts = Counter(
            "specdecode_spec_decode_num_drafts", "Sequence-steps that verified a draft of at least one token.",
            registry=r)
        self.spec_draft_tokens = Counter(
            "specdecode_spec_decode_num_draft_tokens", "Draft tokens proposed.", registry=r)
        self.spec_accepted_tokens = Counter(
            "specdecode_spec_decode_num_accepted_tokens", "Draft tokens accepted by the verifier.", registry=r)
        self.spec_accepted_per_pos = Counter(
            "specdecode_spec_decode_num_accepted_tokens_per_pos",
            "Drafts whose token at this 0-based position was accepted.", ["position"], registry=r)
        self.spec_drafted_per_pos = Counter(
            "specdecode_spec_decode_num_draft_tokens_per_pos",
            "Drafts that proposed a token at this 0-based position (denominator of the per-position rate).",
            ["position"], registry=r)
        self.prefix_cache_queries = Counter(
            "specdecode_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", registry=r)
        self.prefix_cache_hits = Counter(
            "specdecode_prefix_cache_hits", "Prompt tokens served from the prefix cache (not prefilled).", registry=r)
        self.prefix_cache_hit_rate = Gauge(
            "specdecode_prefix_cache_hit_rate", "Prefix-cache hits / queries in prompt tokens, since start-up.",
            registry=r)
        self.prefix_cache_usage = Gauge(
            "specdecode_prefix_cache_usage", "Fraction of the prefix-cache pool's bytes in use.", registry=r)
        self.suffix_cache_tokens = Gauge(
            "specdecode_suffix_cache_tokens", "Tokens of earlier answers held for suffix lookups.", registry=r)
        self.suffix_cache_max_tokens = Gauge(
            "specdecode_suffix_cache_max_tokens", "The bound on those tokens (--suffix-cache-tokens).", registry=r)
        self.suffix_cache_bytes = Gauge(
            "specdecode_suffix_cache_bytes", "Approximate memory of the suffix lookups' store.", registry=r)
        self.requests_finished = Counter(
            "specdecode_requests_finished", "Requests finished, by reason (stop, length, abort, error).",
            ["finish_reason"], registry=r)
        self.request_errors = Counter(
            "specdecode_request_errors", "Requests refused or failed, by HTTP status code.", ["code"], registry=r)
        self.time_to_first_token = Histogram(
            "specdecode_time_to_first_token_seconds", "From admission to the first output token.",
            buckets=LATENCY_BUCKETS, registry=r)
        self.request_latency = Histogram(
            "specdecode_request_latency_seconds", "From admission to the last output token.",
            buckets=LATENCY_BUCKETS, registry=r)

    def observe_spec_delta(self, before: SpecStats | None, after: SpecStats) -> None:
        """Add the counters of ``after`` minus ``before`` (one request's stats between two snapshots)."""
        b_steps_drafted = before.drafted_by_position[0] if before and before.drafted_by_position else 0
        a_steps_drafted = after.drafted_by_position[0] if after.drafted_by_position else 0
        self._inc(self.spec_drafts, a_steps_drafted - b_steps_drafted)
        self._inc(self.spec_draft_tokens, after.draft_tokens - (before.draft_tokens if before else 0))
        self._inc(self.spec_accepted_tokens, after.accepted_tokens - (before.accepted_tokens if before else 0))
        for i, (acc, drafted) in enumerate(zip(after.accepted_by_position, after.drafted_by_position, strict=True)):
            b_acc = before.accepted_by_position[i] if before and i < len(before.accepted_by_position) else 0
            b_dr = before.drafted_by_position[i] if before and i < len(before.drafted_by_position) else 0
            if acc - b_acc > 0:
                self.spec_accepted_per_pos.labels(position=str(i)).inc(acc - b_acc)
            if drafted - b_dr > 0:
                self.spec_drafted_per_pos.labels(position=str(i)).inc(drafted - b_dr)

    @staticmethod
    def _inc(counter: Counter, amount: float) -> None:
        if amount > 0:
            counter.inc(amount)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def snapshot(stats: SpecStats) -> SpecStats:
    """A copy of the counters that ``observe_spec_delta`` compares."""
    return SpecStats(
        steps=stats.steps, draft_tokens=stats.draft_tokens, accepted_tokens=stats.accepted_tokens,
        output_tokens=stats.output_tokens, accepted_by_position=list(stats.accepted_by_position),
        drafted_by_position=list(stats.drafted_by_position),
    )
