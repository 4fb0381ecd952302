"""Which error ends a request that no rung answered: every mix of attempt kinds."""

from __future__ import annotations

import itertools

import pytest

from proxyd.conclusion import conclude
from proxyd.ladder import Attempt, Plan, Skipped, attempts_header
from shared.caps import Verdict
from shared.errors import (
    CONTEXT_LENGTH,
    AllRungsFailed,
    BadRequest,
    ClientError,
    NoPrivateSeat,
    NoRoom,
    Overloaded,
    PromptTooLong,
    SanctumError,
)
from shared.protocol import Failed, Rejected

# One of each kind an attempt that did not answer can end as (other rejections and
# a departed client end the request at once, so they never reach `conclude`).
KINDS: dict[str, Skipped | Failed | Rejected] = {
    "over_cap": Skipped("over_cap", Verdict(5000, 4032, 4096, 64)),
    "circuit_open": Skipped("circuit_open"),
    "queue_full": Failed("queue_full"),
    "queue_timeout": Failed("queue_timeout"),
    "worker_lost": Failed("worker_lost"),
    "upstream_503": Failed("upstream_503"),
    "context_length": Rejected(400, CONTEXT_LENGTH, "too long for me", {"seat": "h"}),
    # a rung that cannot honour a field: skipped, or a hosted rung that refused it unsent
    "unsupported": Skipped("unsupported_field", field="logit_bias"),
    "unsupported_unsent": Failed("unsupported_field", "top_k: upstream takes no top_k"),
    # an on-demand seat seatd found no room for, or could not wake (proxyd/on_demand.py)
    "no_room": Skipped("no_room", detail="seat 'a' (90 MB) cannot load: budget 100 MB"),
    "wake_failed": Skipped("wake_failed", detail="seat 'a' cannot load: gone"),
}
PRIVATE = Plan(("a", "b", "c"), ("hosted",))  # an off-box rung was filtered out
OPEN = Plan(("a", "b", "c"), ())


def attempts(*kinds: str) -> list[Attempt]:
    return [(f"s{i}", KINDS[k]) for i, k in enumerate(kinds)]


# (attempt kinds, plan) -> (error class, code, counter)
TABLE: list[tuple[tuple[str, ...], Plan, type[SanctumError], str, str | None]] = [
    (("over_cap",), OPEN, PromptTooLong, "context_length_exceeded", "over_cap"),
    (("over_cap", "over_cap"), PRIVATE, PromptTooLong, "context_length_exceeded", "over_cap"),
    (("over_cap", "worker_lost"), OPEN, AllRungsFailed, "all_rungs_failed", None),
    (("over_cap", "worker_lost"), PRIVATE, NoPrivateSeat, "no_private_seat", "offbox_blocked"),
    (("over_cap", "circuit_open"), OPEN, AllRungsFailed, "all_rungs_failed", None),
    (("over_cap", "queue_full"), OPEN, Overloaded, "overloaded", "overloaded"),
    (("circuit_open",), OPEN, AllRungsFailed, "all_rungs_failed", None),
    (("circuit_open",), PRIVATE, NoPrivateSeat, "no_private_seat", "offbox_blocked"),
    (("queue_full",), OPEN, Overloaded, "overloaded", "overloaded"),
    (("queue_full", "queue_timeout"), PRIVATE, Overloaded, "overloaded", "overloaded"),
    (("queue_timeout", "circuit_open"), OPEN, Overloaded, "overloaded", "overloaded"),
    (("queue_full", "worker_lost"), OPEN, AllRungsFailed, "all_rungs_failed", None),
    (("queue_full", "worker_lost"), PRIVATE, NoPrivateSeat, "no_private_seat", "offbox_blocked"),
    (("worker_lost", "upstream_503"), OPEN, AllRungsFailed, "all_rungs_failed", None),
    (("worker_lost",), PRIVATE, NoPrivateSeat, "no_private_seat", "offbox_blocked"),
    (("context_length",), OPEN, ClientError, CONTEXT_LENGTH, None),
    (("over_cap", "context_length"), PRIVATE, ClientError, CONTEXT_LENGTH, None),
    (("queue_full", "context_length"), OPEN, ClientError, CONTEXT_LENGTH, None),
    (("context_length", "worker_lost"), PRIVATE, ClientError, CONTEXT_LENGTH, None),
    # no rung can honour a field (or could take the prompt): the client's to fix
    (("unsupported",), OPEN, BadRequest, "unsupported_field", None),
    (("unsupported", "unsupported_unsent"), PRIVATE, BadRequest, "unsupported_field", None),
    (("over_cap", "unsupported"), OPEN, BadRequest, "unsupported_field", None),
    (("unsupported_unsent",), OPEN, BadRequest, "unsupported_field", None),
    # a rung that could have honoured it failed, was busy or shut: not the field's fault
    (("worker_lost", "unsupported"), OPEN, AllRungsFailed, "all_rungs_failed", None),
    (("worker_lost", "unsupported"), PRIVATE, NoPrivateSeat, "no_private_seat",
     "offbox_blocked"),
    (("circuit_open", "unsupported"), OPEN, AllRungsFailed, "all_rungs_failed", None),
    (("queue_full", "unsupported"), OPEN, Overloaded, "overloaded", "overloaded"),
    (("unsupported", "context_length"), OPEN, ClientError, CONTEXT_LENGTH, None),
    # no room for an on-demand seat: nothing failed, retry (busy comes first)
    (("no_room",), OPEN, NoRoom, "no_room", None),
    (("no_room",), PRIVATE, NoRoom, "no_room", None),
    (("no_room", "over_cap"), OPEN, NoRoom, "no_room", None),
    (("no_room", "queue_full"), OPEN, Overloaded, "overloaded", "overloaded"),
    (("no_room", "worker_lost"), OPEN, AllRungsFailed, "all_rungs_failed", None),
    (("wake_failed",), OPEN, AllRungsFailed, "all_rungs_failed", None),
]


@pytest.mark.parametrize(("kinds", "plan", "error", "code", "counter"), TABLE)
def test_conclusion_table(kinds: tuple[str, ...], plan: Plan, error: type[SanctumError],
                          code: str, counter: str | None) -> None:
    """Each mix of skipped, busy, failed and rejected attempts ends with its one error."""
    end = conclude(attempts(*kinds), plan, "r")
    assert type(end.error) is error
    assert (end.error.code, end.counter) == (code, counter)
    assert end.error.extra["attempts"] == attempts_header(attempts(*kinds))


def expected(kinds: tuple[str, ...], plan: Plan) -> type[SanctumError]:
    """The rules of proxyd/conclusion.py, stated over sets of kinds."""
    got = set(kinds)
    busy = {"queue_full", "queue_timeout"}
    skipped = {"over_cap", "circuit_open", "unsupported", "no_room", "wake_failed"}
    unable = {"unsupported", "unsupported_unsent"}
    if "context_length" in got:
        return ClientError
    if got & unable and got <= unable | {"over_cap"}:
        return BadRequest
    if got == {"over_cap"}:
        return PromptTooLong
    if got & busy and got <= busy | skipped | {"unsupported_unsent"}:
        return Overloaded
    if "no_room" in got and got <= skipped | {"unsupported_unsent"}:
        return NoRoom
    if plan.filtered_offbox:
        return NoPrivateSeat
    return AllRungsFailed


MIXES = [kinds for n in (1, 2, 3) for kinds in itertools.product(KINDS, repeat=n)]


@pytest.mark.parametrize("plan", [OPEN, PRIVATE], ids=["offbox_kept", "offbox_filtered"])
def test_every_mix_of_up_to_three_attempts(plan: Plan) -> None:
    """All 1,463 sequences of up to three attempt kinds, with and without off-box rungs
    filtered, end as the rules say, and the error's status matches its class."""
    for kinds in MIXES:
        end = conclude(attempts(*kinds), plan, "r")
        assert type(end.error) is expected(kinds, plan), kinds
        assert end.error.status == (400 if type(end.error) in (ClientError, BadRequest)
                                    else 413 if type(end.error) is PromptTooLong else 503)


def test_over_cap_names_the_largest_allowed_seat() -> None:
    """The 413 quotes the rung with the largest cap: the most a shorter prompt could get."""
    small = Skipped("over_cap", Verdict(9000, 1984, 2048, 64))
    large = Skipped("over_cap", Verdict(9000, 8128, 8192, 64))
    end = conclude([("small", small), ("large", large)], OPEN, "r")
    assert isinstance(end.error, PromptTooLong)
    extra = end.error.extra
    assert (extra["seat"], extra["cap"], extra["prompt_tokens"], extra["margin"]) == (
        "large", 8128, 9000, 64)
    assert "8128" in end.error.message and "8192" in end.error.message
    assert end.refused_tokens == 9000


def test_overloaded_says_retry_after_and_no_private_seat_names_the_filtered() -> None:
    busy = conclude(attempts("queue_full"), OPEN, "r").error
    assert busy.retry_after_s == 1 and busy.status == 503
    private = conclude(attempts("worker_lost"), Plan(("a",), ("h1", "h2")), "r").error
    assert "h1, h2" in private.message


def test_context_refusal_keeps_the_rungs_own_words() -> None:
    """A context-length refusal reaches the client with the rung's status, code and extras."""
    end = conclude(attempts("worker_lost", "context_length"), OPEN, "r")
    assert (end.error.status, end.error.code, end.error.message) == (
        400, CONTEXT_LENGTH, "too long for me")
    assert end.error.extra["seat"] == "h"


def test_unsupported_field_names_the_field_and_every_rung() -> None:
    """The 400 names the field (`param`) and says which rung takes no what."""
    end = conclude([("gpt", Skipped("unsupported_field", field="logit_bias")),
                    ("vllm", Failed("unsupported_field", "logit_bias: no"))], OPEN, "r")
    err = end.error
    assert (err.status, err.code, err.param) == (400, "unsupported_field", "logit_bias")
    assert "gpt takes no logit_bias" in err.message and "vllm" in err.message
    assert err.extra["attempts"] == ("gpt=skipped:unsupported_field; "
                                     "vllm=failed:unsupported_field")
