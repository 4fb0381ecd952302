"""The proxy's own counters, and their Prometheus exposition.

Counters are plain labelled totals held here; `/counters` serves them as JSON
with every seat's own counters beside them, and `/metrics` renders the same
numbers through prometheus-client.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from shared.caps import summarise

REFUSED_SAMPLE = 512

PLAIN = ("requests", "offbox_blocked", "over_cap", "midstream_aborts", "client_disconnects",
         "bad_requests", "cap_disagreements", "overloaded")
# name -> label names
LABELLED: dict[str, tuple[str, ...]] = {
    "answered_by": ("seat",),
    "attempts": ("seat", "outcome"),
    "fallbacks": ("reason",),
    # a stream that broke after its commit and was continued by another rung: why, and
    # from which rung to which (counted when the continuing rung sends its first text)
    "continuations": ("reason", "from_seat", "to_seat"),
    # hosted rungs that answered a continuation's assistant prefill with a 400: asked
    # afresh from then on (proxyd/replay.py); shown under continuations
    "prefill_refused": ("seat",),
    # requests refused at the door: a missing or unknown key, a route the key may not
    # use (proxyd/auth.py); a key over its request rate, by the key's name (never the
    # key); a field over its limit (proxyd/limits.py)
    "auth_failures": ("reason",),
    "rate_limited": ("key",),
    "input_refused": ("field",),
    # requests that found their route still loading: how the wait ended (ready, timeout,
    # down: nothing was loading any more)
    "load_waits": ("outcome",),
    # top-level body fields unknown to the OpenAI API, ignored and listed in
    # X-Sanctum-Ignored (proxyd/doors/openai_fields.py): at most MAX_IGNORED_LABELS names,
    # since clients choose them; the rest are counted as OTHER_FIELD
    "ignored_fields": ("field",),
    # per front door (chat, completions, messages, responses; proxyd/doors/__init__.py):
    # the requests it took, and the errors it answered by their API's error type (a
    # refusal's, or `midstream` for a begun stream that ended with an error event)
    "door_requests": ("door",),
    "door_errors": ("door", "type"),
    # on-demand seats the proxy woke for a request, and those seatd found no room for
    # (proxyd/on_demand.py; seatd counts loads, their time and sleeps by reason)
    "wakes": ("seat",),
    "no_room": ("seat",),
}
# Labelled counters shown in /counters as {label: count}.
ONE_LABEL = ("answered_by", "fallbacks", "auth_failures", "rate_limited", "input_refused",
             "load_waits", "ignored_fields", "door_requests", "wakes", "no_room")
MAX_IGNORED_LABELS = 256
OTHER_FIELD = "_other"


class ProxyCounters:
    def __init__(self) -> None:
        self.plain: dict[str, int] = dict.fromkeys(PLAIN, 0)
        self.labelled: dict[str, dict[tuple[str, ...], int]] = {k: {} for k in LABELLED}
        self.refused_sample: list[int] = []

    def refused(self, prompt_tokens: int) -> None:
        """Remember an over-cap prompt's length, for the median beside `over_cap`."""
        self.refused_sample = [*self.refused_sample[-(REFUSED_SAMPLE - 1):], prompt_tokens]

    def inc(self, name: str, *labels: str, n: int = 1) -> None:
        if name in self.plain:
            self.plain[name] += n
            return
        bucket = self.labelled[name]
        bucket[labels] = bucket.get(labels, 0) + n

    def ignored(self, fields: tuple[str, ...]) -> None:
        """Count a request's ignored fields, each once, under a bounded set of labels."""
        bucket = self.labelled["ignored_fields"]
        for field in fields:
            key = (field,)
            if key not in bucket and len(bucket) >= MAX_IGNORED_LABELS:
                key = (OTHER_FIELD,)
            bucket[key] = bucket.get(key, 0) + 1

    def snapshot(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.plain)
        for name in ONE_LABEL:
            out[name] = {k[0]: v for k, v in self.labelled[name].items()}
        attempts: dict[str, dict[str, int]] = {}
        for (seat, outcome), v in self.labelled["attempts"].items():
            attempts.setdefault(seat, {})[outcome] = v
        out["attempts"] = attempts
        by_reason: dict[str, int] = {}
        by_pair: dict[str, int] = {}
        for (reason, src, dst), v in self.labelled["continuations"].items():
            by_reason[reason] = by_reason.get(reason, 0) + v
            by_pair[f"{src}>{dst}"] = by_pair.get(f"{src}>{dst}", 0) + v
        out["continuations"] = {"by_reason": by_reason, "by_pair": by_pair,
                                "prefill_refused": {k[0]: v for k, v in
                                                    self.labelled["prefill_refused"].items()}}
        door_errors: dict[str, dict[str, int]] = {}
        for (door, kind), v in self.labelled["door_errors"].items():
            door_errors.setdefault(door, {})[kind] = v
        out["door_errors"] = door_errors
        r = summarise(self.plain["over_cap"], self.refused_sample)
        out["over_cap_prompts"] = {"count": r.count, "median": r.median, "max": r.max}
        return out


# Seat values that are a state now, not a total: rendered as gauges.
SEAT_GAUGES = ("prompt_cache_entries", "prompt_cache_bytes", "rows_active", "rows_queued",
               "kv_bytes", "incarnation", "loaded_bytes", "kv_budget_bytes",
               "memory_budget_bytes", "idle_seconds", "mlx_active_bytes", "mlx_cache_bytes",
               "mlx_peak_bytes")
# A local seat's states (proxyd/seat_state.py), one gauge each: 1 for the one it is in.
SEAT_STATES = ("ready", "loading", "down", "sleeping")


class _Snapshot(Collector):
    def __init__(self, proxy: ProxyCounters, seats: Mapping[str, Mapping[str, Any] | None],
                 live: Mapping[str, Mapping[str, int]], states: Mapping[str, str]) -> None:
        self.proxy = proxy
        self.seats = seats
        self.live = live
        self.states = states

    def collect(self) -> Iterator[Metric]:
        for name, value in self.proxy.plain.items():
            fam = CounterMetricFamily(f"sanctum_proxy_{name}", f"proxy {name}")
            fam.add_metric([], value)
            yield fam
        for name, labels in LABELLED.items():
            fam = CounterMetricFamily(f"sanctum_proxy_{name}", f"proxy {name}", labels=list(labels))
            for label_values, value in self.proxy.labelled[name].items():
                fam.add_metric(list(label_values), value)
            yield fam
        up = GaugeMetricFamily("sanctum_seat_up", "seat answered its counters", labels=["seat"])
        plain: dict[str, CounterMetricFamily] = {}
        labelled: dict[str, CounterMetricFamily] = {}
        gauges: dict[str, GaugeMetricFamily] = {}
        for seat, counters in self.seats.items():
            up.add_metric([seat], 0 if counters is None else 1)
            # The batch's state from the seat's last heartbeat, fresher than its counters.
            state = {**(counters or {}), **self.live.get(seat, {})}
            for key in SEAT_GAUGES:
                if isinstance(state.get(key), int):
                    fam_g = gauges.setdefault(key, GaugeMetricFamily(
                        f"sanctum_seat_{key}", f"seat {key} now", labels=["seat"]))
                    fam_g.add_metric([seat], state[key])
            for key, value in (counters or {}).items():
                if isinstance(value, bool) or key in ("started_at", *SEAT_GAUGES):
                    continue
                if isinstance(value, int):
                    fam = plain.setdefault(key, CounterMetricFamily(
                        f"sanctum_seat_{key}", f"seat {key}", labels=["seat"]))
                    fam.add_metric([seat], value)
                elif isinstance(value, dict) and key == "spec_cost_us":
                    fam_c = gauges.setdefault(key, GaugeMetricFamily(
                        "sanctum_seat_spec_cost_us", "seat speculation cost model term now, us",
                        labels=["seat", "term"]))
                    for term, v in value.items():
                        if isinstance(v, int):
                            fam_c.add_metric([seat, str(term)], v)
                elif isinstance(value, dict) and key != "lanes":
                    fam = labelled.setdefault(key, CounterMetricFamily(
                        f"sanctum_seat_{key}", f"seat {key}", labels=["seat", "label"]))
                    for label, v in value.items():
                        if isinstance(v, int):
                            fam.add_metric([seat, str(label)], v)
        yield up
        if self.states:
            fam_s = GaugeMetricFamily("sanctum_seat_state", "seat state now (1: in it)",
                                      labels=["seat", "state"])
            for name, now in self.states.items():
                for kind in SEAT_STATES:
                    fam_s.add_metric([name, kind], 1 if now == kind else 0)
            yield fam_s
        yield from gauges.values()
        yield from plain.values()
        yield from labelled.values()


def render_metrics(proxy: ProxyCounters, seats: Mapping[str, Mapping[str, Any] | None],
                   live: Mapping[str, Mapping[str, int]] | None = None,
                   states: Mapping[str, str] | None = None) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(proxy, seats, live or {}, states or {}))
    return generate_latest(registry)
