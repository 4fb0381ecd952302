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
                       (a model drafter's seat: prompt lookup alone, round by round)
    The seat's figures, of its model drafter as of its lookup, are kept apart for greedy
    and sampled requests (`bands`).
    A model drafter's adaptive rows also draft by prompt lookup where a round is expected
    to pay more that way (`seatd.drafter_choice`); a pinned depth drafts by the model alone.
    drafter raised mid-request               -> declined:drafter_error (in decode)
    drafter never proposed anything          -> declined:no_proposal (in decode)
"""

from __future__ import annotations

import os
from typing import Any

import structlog

from seatd import recurrent
from seatd.adaptive import DepthStats, RoundPolicy, choose_depth, seed_times
from seatd.drafter_choice import LOOKUP_MAX_DEPTH, lookup_policy
from seatd.drafters import MATCH_KEYS, LookupDrafter, ModelDrafter
from seatd.engine_types import Speculation, make_cache
from seatd.prompt_cache import OFF_VALUES
from seatd.spec_costs import SpecCosts
from shared.config import Config, SeatConfig, resolve_path
from shared.protocol import Generate

log = structlog.get_logger()

# Beside a model drafter, the lookup drafts from matches of two or three tokens or more
# (a single token's earlier follower is seldom the target's next; the model drafter does
# better), with figures of their own for each class of how far the match reaches back
# (`seatd.drafters.match_key`).
LOOKUP_ORDERS = (2, 3)  # the n-gram lengths a model seat's lookup matches
# Drafted or judged rounds of one lookup match class after which the seat's figures of it
# are a request's prior for its first match of that class, instead of the request judging
# one match first.
TRUSTED_ROUNDS = 8


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
        # the model drafter's figures, by whether the request samples: above temperature
        # 0 a draft is kept only where the target's draw lands on it, so one drafter
        # keeps fewer there, and figures of both would have a seat that pays greedily
        # speculate at a loss when sampling (as the lookup's below)
        self.bands = {sampled: DepthStats() for sampled in (False, True)}
        # a model drafter's rows' lookup rounds, by whether the request samples
        # (temperature > 0: a one-hot draft is kept only where the target's draw lands
        # on it), then by match class
        self.lookup_stats = {sampled: {n: DepthStats(max_depth=LOOKUP_MAX_DEPTH)
                                       for n in MATCH_KEYS} for sampled in (False, True)}
        # ... and the times of those rounds, every class together (`lookup_policy`)
        self.lookup_rounds = {sampled: DepthStats(max_depth=LOOKUP_MAX_DEPTH)
                              for sampled in (False, True)}
        self.costs = SpecCosts()  # measured by the engine on rounds of a request alone
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

    def cost_snapshot(self) -> dict[str, int]:
        """The cost model's terms (`SpecCosts.snapshot`) and the model drafter's round
        time at each depth it has a figure for, by band (`round_greedy_d{k}`,
        `round_sampled_d{k}`; d0: a plain token), in microseconds: what a request's
        `RoundPolicy` starts from (before its line mends a spike), so an operator sees
        why the seat drafts or not on this device."""
        out = self.costs.snapshot()
        for sampled, stats in self.bands.items():
            band = "sampled" if sampled else "greedy"
            for k, t in sorted(dict(stats.seconds).items()):
                out[f"round_{band}_d{k}"] = round(t * 1e6)
        return out

    def take_times(self, measured: dict[bool, dict[int, float]]) -> None:
        """Round seconds by depth, by band, measured on this device by the warm-up
        (`seatd.warm_shapes.Warming`): the bands' figures start from them, so the
        first requests' rounds are chosen on what a round costs here (`RoundPolicy`)
        instead of drafting at fixed warm depths to learn it."""
        for sampled, seconds in measured.items():
            seed_times(self.bands[sampled], seconds)

    def plan(self, request: Generate, kv: str) -> Speculation | None:
        if self.kind is None:
            return None
        sampled = request.params.temperature > 0
        stats = self.bands[sampled]
        if kill_switch(self.seat):
            return Speculation(None, 0, stats, "kill_switch")
        if request.speculation is False:
            return Speculation(None, 0, stats, "disabled_by_request")
        if self.unusable is not None:
            return Speculation(None, 0, stats, self.unusable)
        if not self.rollback.get(kv, False):
            return Speculation(None, 0, stats, "cache_not_rollbackable")
        policy = None
        if request.draft_depth is not None:  # pinned by the request, for measuring
            depth = request.draft_depth
        elif self.seat.draft_depth is not None:
            depth = self.seat.draft_depth
        else:
            depth = choose_depth(stats)
            policy = RoundPolicy.from_stats(stats)
            if policy is not None and depth > 0:
                depth = stats.max_depth  # the policy picks each round's depth
        if depth == 0 and policy is None:
            return Speculation(None, 0, stats, "not_profitable")
        if policy is None:  # pinned, or warming up: the drafter at that depth
            drafter = ModelDrafter(self.drafter_model) if self.kind == "model" \
                else LookupDrafter()
            return Speculation(drafter, depth, stats, costs=self.costs)
        estimate = [self.costs.round(k, lookup=True) for k in range(LOOKUP_MAX_DEPTH + 1)]
        figures, rounds = self.lookup_stats[sampled], self.lookup_rounds[sampled]
        policies = {n: lookup_policy(policy.base, s, estimate, rounds, policy.own)
                    for n, s in figures.items()}
        # Classes the seat has drafted or judged enough rounds of: a request's first match
        # of one drafts at the seat's figures (its policy's prior, as of now); of any
        # other, it is judged first.
        trusted = frozenset(n for n, s in figures.items()
                            if sum(c for d, c in s.seen.items() if d > 0) >= TRUSTED_ROUNDS)
        lookup = LookupDrafter(max(LOOKUP_ORDERS), min(LOOKUP_ORDERS))
        if depth == 0 or self.kind != "model":
            # The model drafter does not pay on this seat now (or the seat has only the
            # lookup): prompt lookup still may, round by round, by its match's class (a
            # plain token where that does not pay), from the same n-grams as beside a
            # model drafter.  Each class keeps its own figures, so stray bigrams, which
            # seldom hold, never park the copies, which do; and where a sampled answer
            # strays from a copy for a token, a bigram takes the copy up again a step
            # before a trigram would (on the bench's copy-heavy prompts at T=0.7, 10-25%
            # fewer steps a request than trigrams alone).
            n = lookup.max_ngram
            return Speculation(lookup, LOOKUP_MAX_DEPTH, figures[n], policy=policies[n],
                               lookup_stats=figures, lookup_policies=policies,
                               lookup_rounds=rounds, costs=self.costs, lookup_trusted=trusted)
        # Each round may draft by lookup instead of the model (`seatd.drafter_choice`).
        return Speculation(ModelDrafter(self.drafter_model), depth, stats, policy=policy,
                           lookup=lookup,
                           lookup_stats=figures, lookup_policies=policies,
                           lookup_rounds=rounds, costs=self.costs, lookup_trusted=trusted)
