"""A seat's speculation set-up: its drafter, and why a request may decline.

Loaded once with the model, on the MLX thread.  For each request `plan` says
how to speculate, or which reason to decline with; the decode loop does the rest.

    no drafter configured                    -> "off"
    SANCTUM_SPECULATION=0 or speculation=false -> declined:kill_switch
    the request's `sanctum.speculation=false`  -> declined:disabled_by_request
    drafter failed to load                   -> declined:no_drafter
    drafter's tokenizer differs              -> declined:tokenizer_mismatch
    cache cannot roll back (recurrent state) -> declined:cache_not_rollbackable
    adaptive depth parked at 0               -> declined:not_profitable
    drafter raised mid-request               -> declined:drafter_error (in decode)
    drafter never proposed anything          -> declined:no_proposal (in decode)
"""

from __future__ import annotations

import os
from typing import Any

import structlog

from seatd import recurrent
from seatd.adaptive import DepthStats, RoundPolicy, choose_depth
from seatd.decode import Speculation, make_cache
from seatd.drafters import LookupDrafter, ModelDrafter
from seatd.prompt_cache import OFF_VALUES
from shared.config import Config, SeatConfig, resolve_path
from shared.protocol import Generate

log = structlog.get_logger()


def kill_switch(seat: SeatConfig) -> bool:
    """`SANCTUM_SPECULATION` = off/0/false/no (as the launchd plists write it), or the seat's
    `speculation = false`: no rebuild, no config edit needed for the first."""
    value = os.environ.get("SANCTUM_SPECULATION", "on").strip().lower()
    return value in OFF_VALUES or not seat.speculation


def _can_roll_back(model: Any, kv: str) -> bool:
    try:
        return recurrent.can_roll_back(make_cache(model, kv))
    except (ValueError, AttributeError):  # no KV cache of this kind for this model
        return False


class SeatSpeculation:
    def __init__(self, config: Config, seat: SeatConfig, target: Any, target_hash: str) -> None:
        self.seat = seat
        self.stats = DepthStats()
        self.drafter_model: Any = None
        self.unusable: str | None = None
        self.kind = seat.drafter.kind if seat.drafter else None
        self.rollback = {kv: _can_roll_back(target, kv) for kv in ("fp16", "q8")}
        if seat.drafter is None or seat.drafter.kind != "model":
            return
        from seatd.model_load import load_for_compute
        from shared.builtin import resolve_model

        assert seat.drafter.path is not None
        try:
            path = resolve_model(resolve_path(config, seat.drafter.path))
            if not path.exists():
                raise FileNotFoundError(f"{path} does not exist")
            dtype = None if seat.compute_dtype == "auto" else seat.compute_dtype
            loaded = load_for_compute(path, dtype, seat.trust_remote_code)
        except Exception as exc:  # a drafter that cannot load costs speed, not the seat
            log.error("drafter_load_failed", path=seat.drafter.path, error=str(exc))
            self.unusable = "no_drafter"
            return
        if loaded.tokenizer_hash != target_hash:
            log.warning("drafter_tokenizer_mismatch", path=seat.drafter.path)
            self.unusable = "tokenizer_mismatch"
            return
        self.drafter_model = loaded.model

    def plan(self, request: Generate, kv: str) -> Speculation | None:
        if self.kind is None:
            return None
        if kill_switch(self.seat):
            return Speculation(None, 0, self.stats, "kill_switch")
        if request.speculation is False:
            return Speculation(None, 0, self.stats, "disabled_by_request")
        if self.unusable is not None:
            return Speculation(None, 0, self.stats, self.unusable)
        if not self.rollback.get(kv, False):
            return Speculation(None, 0, self.stats, "cache_not_rollbackable")
        policy = None
        if request.draft_depth is not None:  # pinned by the request, for measuring
            depth = request.draft_depth
        elif self.seat.draft_depth is not None:
            depth = self.seat.draft_depth
        else:
            depth = choose_depth(self.stats)
            policy = RoundPolicy.from_stats(self.stats)
            if policy is not None and depth > 0:
                depth = self.stats.max_depth  # the policy picks each round's depth
        if depth == 0:
            return Speculation(None, 0, self.stats, "not_profitable")
        drafter = ModelDrafter(self.drafter_model) if self.kind == "model" else LookupDrafter()
        return Speculation(drafter, depth, self.stats, policy=policy)
