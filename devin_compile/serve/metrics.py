"""Prometheus metrics of the server (``prometheus_client``), scraped at ``GET /metrics``.

Per-request figures are observed when a request ends; engine state (queue, running
sequences, KV blocks, prefix-cache hits, preemptions) is read at scrape time by a custom
collector, so a step never pays for it. Names follow the Prometheus conventions (base
units in the name, ``_total`` counters), all under ``devin_``:

- ``devin_requests_total{endpoint, status}``: requests answered, by HTTP status
  (``499``: the client went away; ``408``: its ``timeout`` ran out);
- ``devin_prompt_tokens_total``, ``devin_generation_tokens_total``;
- ``devin_time_to_first_token_seconds``, ``devin_inter_token_latency_seconds``,
  ``devin_request_duration_seconds`` (end to end), histograms;
- ``devin_queue_requests`` (submitted, no token yet), ``devin_running_sequences``,
  ``devin_kv_blocks_used``, ``devin_kv_blocks_total``;
- ``devin_prefix_cache_hit_tokens_total``, ``devin_preemptions_total``,
  ``devin_kv_prune_evicted_tokens_total``;
- with KV cache tiers, per tier ``devin_kv_tier_{hits,misses,rejected,errors}_total``,
  ``devin_kv_tier_load_seconds_total``, ``devin_kv_tier_bytes``, and with a write-through tier
  ``devin_kv_tier_write_through_{published,dropped,failed}_total`` and
  ``devin_kv_tier_write_through_queue_blocks``;
- ``devin_spec_draft_tokens_total``, ``devin_spec_accepted_tokens_total``: speculative proposals
  verified and accepted (the engine's running totals, 0 without speculation; their ratio is the
  acceptance rate).

Each server has its own registry (several in one process do not collide).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)
_E2E = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


class _EngineCollector:
    def __init__(self, engine, queued) -> None:
        self.engine, self.queued = engine, queued

    def collect(self):
        e = self.engine
        yield GaugeMetricFamily("devin_queue_requests", "Requests submitted that have no token yet",
                                value=self.queued())
        yield GaugeMetricFamily("devin_running_sequences", "Sequences in the running batch",
                                value=len(e.scheduler.running))
        yield GaugeMetricFamily("devin_kv_blocks_used", "KV-cache blocks held by requests",
                                value=e.kv.allocator.num_used)
        yield GaugeMetricFamily("devin_kv_blocks_total", "KV-cache blocks in the pool", value=e.kv.allocator.num_blocks)
        hits = e.kv.prefix_cache.stats.hit_tokens if e.kv.prefix_cache is not None else 0
        yield CounterMetricFamily("devin_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache",
                                  value=hits)
        yield CounterMetricFamily("devin_preemptions", "Sequences preempted for KV space",
                                  value=e.metrics.preemptions)
        totals = e.spec.totals if e.spec is not None else None
        yield CounterMetricFamily("devin_spec_draft_tokens", "Speculative proposals verified",
                                  value=totals.drafted if totals is not None else 0)
        yield CounterMetricFamily("devin_spec_accepted_tokens", "Speculative proposals accepted",
                                  value=totals.accepted if totals is not None else 0)
        if e.kv.tiers is not None:
            yield from _tier_metrics(e.kv.tiers.stats())


def _tier_metrics(stats: dict):
    """Per KV-cache tier (label ``tier``: its position and backend, e.g. ``0:host_lru``)."""
    families = {
        "hits": CounterMetricFamily("devin_kv_tier_hits", "Prefix KV blocks loaded from a cache tier",
                                    labels=["tier"]),
        "misses": CounterMetricFamily("devin_kv_tier_misses", "Prefix KV block lookups a cache tier missed",
                                      labels=["tier"]),
        "rejected": CounterMetricFamily("devin_kv_tier_rejected", "Cache-tier values rejected (header mismatch) "
                                        "and recomputed", labels=["tier"]),
        "errors": CounterMetricFamily("devin_kv_tier_errors", "Cache-tier store faults (e.g. Redis down)",
                                      labels=["tier"]),
        "load_seconds": CounterMetricFamily("devin_kv_tier_load_seconds", "Time spent loading from a cache tier",
                                            labels=["tier"]),
        "bytes": GaugeMetricFamily("devin_kv_tier_bytes", "Bytes a cache tier holds", labels=["tier"]),
    }
    for i, t in enumerate(stats["kv_tiers"]):
        label = [f"{i}:{t['backend']}"]
        for key in ("hits", "misses", "rejected", "errors", "bytes"):
            families[key].add_metric(label, t[key] or 0)
        families["load_seconds"].add_metric(label, t["load_ms"] / 1e3)
    yield from families.values()
    if "kv_tier_write_through_published" in stats:
        w = "kv_tier_write_through_"
        yield CounterMetricFamily("devin_kv_tier_write_through_published", "Prefix KV blocks stored in the "
                                  "write-through tiers when registered", value=stats[w + "published"])
        yield CounterMetricFamily("devin_kv_tier_write_through_dropped", "Registered blocks not written through "
                                  "because the queue was full", value=stats[w + "dropped"])
        yield CounterMetricFamily("devin_kv_tier_write_through_failed", "Write-through stores that failed "
                                  "(e.g. Redis down)", value=stats[w + "failed"])
        yield GaugeMetricFamily("devin_kv_tier_write_through_queue_blocks", "Blocks waiting to be written through",
                                value=stats[w + "queue_depth"])


class ServerMetrics:
    """The server's metrics; ``engine`` is read at scrape time, ``queued()`` gives the queue length."""

    def __init__(self, engine, queued) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("devin_requests", "Requests answered, by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("devin_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("devin_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("devin_time_to_first_token_seconds", "Request received to first token",
                              buckets=_LATENCY, registry=r)
        self.itl = Histogram("devin_inter_token_latency_seconds", "Time between a sequence's tokens",
                             buckets=_LATENCY, registry=r)
        self.e2e = Histogram("devin_request_duration_seconds", "Request received to last token",
                             buckets=_E2E, registry=r)
        self.kv_evicted = Counter("devin_kv_prune_evicted_tokens", "KV entries evicted by KV pruning", registry=r)
        r.register(_EngineCollector(engine, queued))

    def request_done(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def sequence_done(self, prompt_tokens: int, output, ttft: float | None, e2e: float) -> None:
        """One engine request (a choice) ended; ``output`` is its last RequestOutput."""
        self.prompt_tokens.inc(prompt_tokens)
        if output is None:
            return
        self.generation_tokens.inc(len(output.output_ids))
        if ttft is not None:
            self.ttft.observe(ttft)
        self.e2e.observe(e2e)
        m = output.metrics
        if m is not None:
            for dt in m.inter_token_latencies:
                self.itl.observe(dt)
            if m.kv_evicted_tokens:
                self.kv_evicted.inc(m.kv_evicted_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
