"""Counters of the HTTP gateway and their Prometheus / JSON renderings (GET /metrics).

The gateway's own numbers cover the jobs it served (HTTP traffic); the daemon's counters, fetched
at scrape time, cover every client of the shared worker.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

_DAEMON_GAUGES = ("queued", "jobs_done", "jobs_failed", "jobs_cancelled", "tokens_generated", "restarts",
                  "clients_gone", "bad_frames", "uptime_s")


def sample_value(v: float) -> str:
    """A sample's value, exactly: `:g` kept 6 digits, so a counter past 999999 printed as
    1.23457e+06 and stood still between scrapes. Infinities and NaN in Prometheus' spelling."""
    if isinstance(v, int):
        return str(int(v))  # int(): a bool is 0 or 1
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


@dataclass
class GatewayMetrics:
    started: float = field(default_factory=time.time)
    requests: Counter = field(default_factory=Counter)  # (route, status) -> count
    jobs: int = 0
    finish: Counter = field(default_factory=Counter)  # finish reason -> count
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0
    accepted_drafts: int = 0
    cycles: int = 0
    decode_s: float = 0.0
    ttft_s: float = 0.0
    ttft_jobs: int = 0  # jobs that made a first token (one cancelled during its prefill made none)
    last: dict = field(default_factory=dict)

    def request(self, route: str, status: int) -> None:
        self.requests[(route, status)] += 1

    def job(self, stats: dict, reason: str) -> None:
        """Add one finished job's engine stats."""
        self.jobs += 1
        self.finish[reason] += 1
        gen = int(stats.get("generated_tokens", 0))
        self.prompt_tokens += int(stats.get("prompt_tokens", 0))
        self.cached_prompt_tokens += int(stats.get("cached_prompt_tokens", 0))
        self.completion_tokens += gen
        self.accepted_drafts += int(stats.get("accepted_drafts", 0))
        self.cycles += int(stats.get("cycles", 0))
        tps = float(stats.get("decode_tps") or 0.0)
        self.decode_s += gen / tps if tps > 0 else 0.0
        if gen > 0:
            self.ttft_s += float(stats.get("ttft_s") or 0.0)
            self.ttft_jobs += 1
        self.last = {k: stats.get(k) for k in ("acceptance", "tokens_per_cycle", "decode_tps", "prefill_tps", "ttft_s")}

    def summary(self) -> dict[str, Any]:
        """Totals and ratios over the jobs served so far."""
        n, gen = self.jobs, self.completion_tokens
        return {
            "jobs": n,
            "finish_reasons": dict(self.finish),
            "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "completion_tokens": gen,
            "accepted_drafts": self.accepted_drafts,
            "cycles": self.cycles,
            "acceptance": self.accepted_drafts / gen if gen else 0.0,
            "tokens_per_cycle": gen / self.cycles if self.cycles else 0.0,
            "decode_tokens_per_second": gen / self.decode_s if self.decode_s else 0.0,
            "mean_ttft_s": self.ttft_s / self.ttft_jobs if self.ttft_jobs else 0.0,
            "last_job": self.last,
        }

    def as_json(self, daemon: dict | None) -> dict[str, Any]:
        return {
            "gateway": {"uptime_s": round(time.time() - self.started, 3),
                        "requests": [{"route": r, "status": s, "count": c} for (r, s), c in sorted(self.requests.items())],
                        **self.summary()},
            "daemon": daemon,
        }

    def prometheus(self, daemon: dict | None) -> str:
        """Prometheus text exposition format (version 0.0.4)."""
        s = self.summary()
        out: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            out.append(f"# HELP dflash_{name} {help_}")
            out.append(f"# TYPE dflash_{name} {kind}")
            out.extend(f"dflash_{name}{labels} {sample_value(value)}" for labels, value in samples)

        reqs = [(f'{{route="{r}",status="{st}"}}', c) for (r, st), c in sorted(self.requests.items())]
        metric("http_requests_total", "counter", "HTTP requests answered, by route and status.", reqs)
        metric("gateway_jobs_total", "counter", "Generations served over HTTP.", [("", s["jobs"])])
        for key, help_ in (("prompt_tokens", "Prompt tokens of HTTP jobs."),
                           ("cached_prompt_tokens", "Prompt tokens served from the prefix cache."),
                           ("completion_tokens", "Tokens generated for HTTP jobs."),
                           ("accepted_drafts", "Draft tokens accepted by the target."),
                           ("cycles", "Draft/verify cycles.")):
            metric(f"gateway_{key}_total", "counter", help_, [("", s[key])])
        metric("gateway_acceptance_ratio", "gauge", "Accepted draft tokens / generated tokens.", [("", s["acceptance"])])
        metric("gateway_tokens_per_cycle", "gauge", "Generated tokens per draft/verify cycle.", [("", s["tokens_per_cycle"])])
        metric("gateway_decode_tokens_per_second", "gauge", "Generated tokens / decode time over HTTP jobs.",
               [("", s["decode_tokens_per_second"])])
        metric("gateway_mean_ttft_seconds", "gauge", "Mean time to first token (engine side).", [("", s["mean_ttft_s"])])
        metric("daemon_up", "gauge", "1 when the worker answered this scrape.", [("", 1.0 if daemon else 0.0)])
        if daemon:
            metric("daemon_ready", "gauge", "1 when the model is loaded.", [("", 1.0 if daemon.get("state") == "ready" else 0.0)])
            for key in _DAEMON_GAUGES:
                if isinstance(daemon.get(key), (int, float)):
                    metric(f"daemon_{key}", "gauge", f"Worker counter {key} (all clients).", [("", daemon[key])])
        return "\n".join(out) + "\n"
