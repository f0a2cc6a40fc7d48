"""Prometheus metrics (own registry, so several apps in one process never collide)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class Metrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("mlxb_requests", "Requests finished, by endpoint and outcome", ["endpoint", "outcome"], registry=r)
        self.tokens = Counter("mlxb_generated_tokens", "Generated tokens", registry=r)
        self.prompt_tokens = Counter("mlxb_prompt_tokens", "Prompt tokens", registry=r)
        self.ttft = Histogram("mlxb_time_to_first_token_seconds", "Time to first token", buckets=BUCKETS, registry=r)
        self.itl = Histogram("mlxb_inter_token_latency_seconds", "Inter-token latency at the server", buckets=BUCKETS, registry=r)
        self.active = Gauge("mlxb_active_rows", "Rows decoding or prefilling", registry=r)
        self.pending = Gauge("mlxb_pending_rows", "Rows waiting for admission", registry=r)
        self.kv = Gauge("mlxb_kv_bytes", "KV cache bytes held by the running batch", registry=r)
        self.prompt_cache = Gauge("mlxb_prompt_cache", "Prompt cache, cumulative counts and current sizes "
                                  "(hits, misses, cached_tokens, ram_bytes, ssd_bytes, evictions, spills, restores, "
                                  "load_s, ...)", ["stat"], registry=r)
        self.shared = Gauge("mlxb_shared_prefix", "Shared-prefix KV (prefix_tokens, rows_sharing, shared_bytes, "
                            "bytes_saved, prefixes, rows_shared, unshared)", ["stat"], registry=r)

    def render(self, stats: dict) -> bytes:
        self.active.set(stats["active_rows"])
        self.pending.set(stats["pending_rows"])
        self.kv.set(stats["kv_bytes"])
        for k, v in (stats.get("prompt_cache") or {}).items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                self.prompt_cache.labels(k).set(v)
        for k, v in (stats.get("shared_prefix") or {}).items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                self.shared.labels(k).set(v)
        return generate_latest(self.registry)
