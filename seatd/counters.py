"""A seat's own counters: lifetime totals that survive restarts.

The worker owns them.  After every request they are written atomically (write a
temporary file, then rename), and a new incarnation starts from the saved
totals, so `served` never goes backwards.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from seatd.memory import MLX_GAUGES
from shared.caps import summarise
from shared.private_files import write_private

if TYPE_CHECKING:  # the engine's module needs MLX; its counts are plain dicts
    from seatd.batch import Drained

log = structlog.get_logger()

# Plain totals and labelled totals (DESIGN.md, "Seat counters").
PLAIN = (
    "served",
    "failed",
    "cancelled",
    "prompt_tokens",
    "completion_tokens",
    "accelerated",
    "spec_drafts",
    "spec_draft_tokens",
    "spec_accepted_tokens",
    "prompt_cache_lookups",
    "prompt_cache_hits",
    "prompt_cache_reused_tokens",
    "bad_frames",
    "curve_denied",  # clients refused by the seat's CURVE handler (shared/curve.py)
    "constrained",  # requests decoded under a grammar (response_format, forced tool calls)
    "tool_calls",  # tool calls parsed out of answers (seatd/tool_calls.py)
    "tool_parse_failures",  # tool-call text that did not parse; sent on as text
)
# bad_frames_by_reason: the frames counted in bad_frames, by why they were refused
# (shared/protocol.py BAD_FRAME_REASONS)
# spec_*_by_drafter: the speculation totals split by who drafted (DRAFTERS)
DRAFTERS = ("model", "lookup")
# Where a batch engine's working time goes, each part counted apart
# (`seatd.batch.Engine.drain`, `engine_us{part}` and `engine_calls{part}`): prefill
# forwards of joining rows, model drafters taking their prompts, plain and verify decode
# steps (each whole but for a drafter's prompt taken in it), and the rest of its steps
# (admission, cancels, riding prompts' bookkeeping, the outbox).
PARTS = ("prefill", "drafter_prefill", "plain", "verify", "other")
# A plain decode step's time by stage (`plain_step_us{stage}`, within its `plain` part):
# building its graph, MLX dispatching it, the host waiting for the last step's tokens,
# and taking them into the answers (`seatd.batch.Engine._plain_step`).
STAGES = ("graph", "dispatch", "wait", "take")
LABELLED = ("rejected", "declined", "prompt_cache_discarded_tokens", "batch_steps",
            "batch_step_us", "engine_calls", "engine_us", "plain_step_us",
            "bad_frames_by_reason", "spec_drafts_by_drafter", "spec_draft_tokens_by_drafter",
            "spec_accepted_by_drafter")
# Prompt lengths of refused (413) prompts kept for the median; the count is exact.
REFUSED_SAMPLE = 512
# Counted per lane as well as in total.
PER_LANE = ("served", "prompt_tokens", "completion_tokens", "accelerated", "declined",
            "spec_drafts", "spec_draft_tokens", "spec_accepted_tokens",
            "prompt_cache_lookups", "prompt_cache_hits", "prompt_cache_reused_tokens")


class SeatCounters:
    def __init__(self, seat: str, path: Path | None) -> None:
        self.seat = seat
        self.path = path
        self.totals: dict[str, int] = dict.fromkeys(PLAIN, 0)
        self.labelled: dict[str, dict[str, int]] = {name: {} for name in LABELLED}
        self.lanes: dict[str, dict[str, Any]] = {}
        self.refused_sample: list[int] = []
        self.positions: list[int] = []  # spec_accepted_per_position, all lanes
        self.incarnation = 1
        self.started_at = time.time()
        # The prompt cache's state now (not totals: a new incarnation starts empty).
        self.gauges: dict[str, int] = {"prompt_cache_entries": 0, "prompt_cache_bytes": 0,
                                       "rows_active": 0, "rows_queued": 0, "kv_bytes": 0,
                                       **dict.fromkeys(MLX_GAUGES, 0)}
        # The speculation cost model's terms now, in microseconds (`seatd.spec_costs`).
        self.spec_costs: dict[str, int] = {}
        self.device = ""  # what computes: backend and device name (`seatd.backend`)
        self._load()

    def _load(self) -> None:
        if self.path is None or not self.path.exists():
            return
        try:
            saved = json.loads(self.path.read_text())
        except (OSError, ValueError) as exc:
            # A torn or foreign file must not stop the seat; say so and start over.
            log.warning("counters_unreadable", path=str(self.path), error=str(exc))
            return
        for name in PLAIN:
            self.totals[name] = int(saved.get(name, 0))
        for name in LABELLED:
            self.labelled[name] = {str(k): int(v) for k, v in saved.get(name, {}).items()}
        self.lanes = saved.get("lanes", {})
        self.positions = [int(n) for n in saved.get("spec_accepted_per_position", [])]
        self.refused_sample = [int(n) for n in saved.get("refused_sample", [])][-REFUSED_SAMPLE:]
        self.incarnation = int(saved.get("incarnation", 0)) + 1

    def inc(self, name: str, n: int = 1, *, label: str | None = None,
            lane: str | None = None) -> None:
        if label is None:
            self.totals[name] += n
        else:
            bucket = self.labelled[name]
            bucket[label] = bucket.get(label, 0) + n
        if lane is not None and name in PER_LANE:
            per = self.lanes.setdefault(lane, {})
            if label is None:
                per[name] = per.get(name, 0) + n
            else:
                sub = per.setdefault(name, {})
                sub[label] = sub.get(label, 0) + n

    def speculation(self, report: Any, lane: str) -> None:
        """Count what speculation did for one served request (an engine_types.SpecReport)."""
        state: str = report.state
        if state == "accelerated":
            self.inc("accelerated", lane=lane)
            self.inc("spec_drafts", report.drafts, lane=lane)
            self.inc("spec_draft_tokens", report.draft_tokens, lane=lane)
            self.inc("spec_accepted_tokens", report.accepted_tokens, lane=lane)
            for i, n in enumerate(report.accepted_per_position):
                self._position(self.positions, i, n)
                per = self.lanes.setdefault(lane, {}).setdefault("spec_accepted_per_position", [])
                self._position(per, i, n)
            for drafter, (rounds, drafted, kept) in report.by_drafter.items():
                self.inc("spec_drafts_by_drafter", rounds, label=drafter)
                self.inc("spec_draft_tokens_by_drafter", drafted, label=drafter)
                self.inc("spec_accepted_by_drafter", kept, label=drafter)
        elif state.startswith("declined:"):
            self.inc("declined", label=state.split(":", 1)[1], lane=lane)

    def prompt_cache(self, tally: Any, lane: str, entries: int, nbytes: int) -> None:
        """Add what the prompt cache did (a prefix_cache.Tally) and its size now."""
        self.inc("prompt_cache_lookups", tally.lookups, lane=lane)
        self.inc("prompt_cache_hits", tally.hits, lane=lane)
        self.inc("prompt_cache_reused_tokens", tally.reused_tokens, lane=lane)
        for reason, tokens in tally.discarded.items():
            self.inc("prompt_cache_discarded_tokens", tokens, label=reason)
        self.gauges.update(prompt_cache_entries=entries, prompt_cache_bytes=nbytes)

    def batch(self, drained: Drained, rows: int, queued: int, kv_bytes: int) -> None:
        """What the batch engine counted (`seatd.batch.Engine.drain`): decode steps by
        batch size (`batch_steps{size}`) and their time in microseconds
        (`batch_step_us{size}`); where its working time went, by part
        (PARTS): calls (`engine_calls{part}`) and microseconds
        (`engine_us{part}`); a plain step's microseconds by stage (STAGES,
        `plain_step_us{stage}`); and the batch's state now."""
        for name, counted in (("batch_steps", drained.steps), ("batch_step_us", drained.step_us),
                              ("engine_calls", drained.part_calls),
                              ("engine_us", drained.part_us),
                              ("plain_step_us", drained.stage_us)):
            for label, n in counted.items():
                self.inc(name, n, label=str(label))
        self.gauges.update(rows_active=rows, rows_queued=queued, kv_bytes=kv_bytes)

    def memory(self, held: Mapping[str, int]) -> None:
        """What MLX holds now (`seatd.memory.mlx_memory`): gauges, as of the last
        request's end or idle trim (`seatd.idle_trim`)."""
        self.gauges.update({name: int(held[name]) for name in MLX_GAUGES if name in held})

    @staticmethod
    def _position(into: list[int], i: int, n: int) -> None:
        while len(into) <= i:
            into.append(0)
        into[i] += n

    def refused(self, prompt_tokens: int) -> None:
        """Remember the length of a prompt refused as too long (beside rejected{413})."""
        self.refused_sample = [*self.refused_sample[-(REFUSED_SAMPLE - 1):], prompt_tokens]

    @property
    def served(self) -> int:
        return self.totals["served"]

    def snapshot(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.totals)
        out.update({name: dict(v) for name, v in self.labelled.items()})
        out["spec_accepted_per_position"] = list(self.positions)
        out["lanes"] = json.loads(json.dumps(self.lanes))
        r = summarise(self.labelled["rejected"].get("413", 0), self.refused_sample)
        out["refused_prompts"] = {"count": r.count, "median": r.median, "max": r.max}
        out.update(self.gauges)
        out["spec_cost_us"] = dict(self.spec_costs)
        if self.device:
            out["device"] = self.device
        out["incarnation"] = self.incarnation
        out["started_at"] = self.started_at
        return out

    def persist(self) -> None:
        if self.path is None:
            return
        write_private(self.path,
                      json.dumps({**self.snapshot(), "refused_sample": self.refused_sample}))
