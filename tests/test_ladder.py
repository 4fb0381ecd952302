"""Ladder decisions: every outcome in every phase, and privacy filtering."""

import itertools

import pytest

from proxyd.ladder import (
    GRAMMAR_ERROR,
    UNSUPPORTED,
    Health,
    Phase,
    Segment,
    Skipped,
    Step,
    attempts_header,
    breaker_verdict,
    context_refusal,
    continued,
    decide,
    fallback_reason,
    offbox_allowed,
    plan,
    prefix_ids,
    unsupported,
)
from shared.config import RouteConfig, SeatConfig
from shared.protocol import (
    Cancelled,
    ChatMessage,
    Failed,
    Generate,
    Ok,
    Rejected,
    SamplingParams,
)

OUTCOMES = {
    "ok": Ok(),
    "rejected_400": Rejected(400, "bad", "x"),
    "rejected_404": Rejected(404, "nf", "x"),
    "rejected_413": Rejected(413, "prompt_too_long", "x"),
    "rejected_422": Rejected(422, "unprocessable", "x"),
    "rejected_400_content_policy": Rejected(400, "content_policy_violation", "x"),
    "context_length": Rejected(400, "context_length_exceeded", "x"),
    "failed_worker_lost": Failed("worker_lost"),
    "failed_not_ready": Failed("not_ready"),
    "failed_first_token_timeout": Failed("first_token_timeout"),
    "failed_stall": Failed("stall_timeout"),
    "failed_internal": Failed("internal_error"),
    "cancelled": Cancelled(),
}
EXPECTED = {
    ("ok", Phase.BEFORE_COMMIT): Step.DONE,
    ("ok", Phase.AFTER_COMMIT): Step.DONE,
    ("cancelled", Phase.BEFORE_COMMIT): Step.STOP,
    ("cancelled", Phase.AFTER_COMMIT): Step.STOP,
}
for name in OUTCOMES:
    if name.startswith("rejected"):
        EXPECTED[(name, Phase.BEFORE_COMMIT)] = Step.RETURN_ERROR
        # After commit a rejection is a continuing rung refusing the continuation.
        EXPECTED[(name, Phase.AFTER_COMMIT)] = Step.CONTINUE
    if name.startswith("failed"):
        EXPECTED[(name, Phase.BEFORE_COMMIT)] = Step.NEXT_RUNG
        EXPECTED[(name, Phase.AFTER_COMMIT)] = Step.CONTINUE
# A context-length rejection may fit a later, larger rung.
EXPECTED[("context_length", Phase.BEFORE_COMMIT)] = Step.NEXT_RUNG
EXPECTED[("context_length", Phase.AFTER_COMMIT)] = Step.CONTINUE


@pytest.mark.parametrize(("name", "phase"), list(itertools.product(OUTCOMES, Phase)))
def test_decide_covers_every_outcome_and_phase(name: str, phase: Phase) -> None:
    """Fallback on a real failure before commit, continuation after it; client errors
    before commit go back as they are."""
    assert decide(OUTCOMES[name], phase) is EXPECTED[(name, phase)]


def test_table_is_complete() -> None:
    """The expectation table names every combination, so a new outcome must be added."""
    assert set(EXPECTED) == set(itertools.product(OUTCOMES, Phase))


SEATS = {
    "brain": SeatConfig(name="brain", model="m"),
    "coder": SeatConfig(name="coder", model="m"),
    "hosted": SeatConfig(name="hosted", kind="openai", base_url="https://x.invalid/v1",
                         offbox=True),
}


@pytest.mark.parametrize(
    ("policy", "header", "allowed"),
    [
        ("deny", None, False),
        ("deny", "allow", False),
        ("allow", None, True),
        ("header", None, False),
        ("header", "deny", False),
        ("header", "allow", True),
        ("header", " Allow ", True),
    ],
)
def test_offbox_policy(policy: str, header: str | None, allowed: bool) -> None:
    """Only `allow`, or `header` with the opt-in header, lets a request leave the box."""
    route = RouteConfig(model="brain", ladder=["brain", "hosted"], offbox=policy)  # type: ignore[arg-type]
    assert offbox_allowed(route, header) is allowed


def test_private_plan_filters_offbox_rungs_before_any_attempt() -> None:
    """A private request's plan never contains an off-box seat."""
    route = RouteConfig(model="brain", ladder=["brain", "hosted", "coder"])
    private = plan(route, SEATS, may_leave=False)
    assert private.rungs == ("brain", "coder")
    assert private.filtered_offbox == ("hosted",)
    public = plan(route, SEATS, may_leave=True)
    assert public.rungs == ("brain", "hosted", "coder")
    assert public.filtered_offbox == ()


def test_fallback_reason_and_context_refusal() -> None:
    """A context-length rejection falls back under its code and is the answer if nothing else is."""
    ctx = Rejected(400, "context_length_exceeded", "too long")
    assert fallback_reason(Failed("stall_timeout")) == "stall_timeout"
    assert fallback_reason(ctx) == "context_length_exceeded"
    assert context_refusal([("a", Failed("worker_lost")), ("b", ctx),
                            ("c", Failed("upstream_503"))]) is ctx
    assert context_refusal([("a", Failed("worker_lost")), ("b", Skipped("circuit_open"))]) \
        is None


def test_attempts_header() -> None:
    """The attempts header lists every rung tried, in order, with its outcome."""
    header = attempts_header([("brain", Failed("worker_lost")), ("small", Skipped("over_cap")),
                              ("coder", Ok())])
    assert header == "brain=failed:worker_lost; small=skipped:over_cap; coder=ok"
    # At the commit point the answering attempt has not ended: never `ok` yet.
    assert attempts_header([("brain", Failed("worker_lost"))], streaming="coder") \
        == "brain=failed:worker_lost; coder=streaming"


GEN = Generate("r1", True, SamplingParams(max_tokens=60, seed=7),
               messages=(ChatMessage("user", "hi"),))


@pytest.mark.parametrize(("hosted", "ids", "max_tokens", "want_ids"), [
    (True, (1, 2, 3), 20, None),       # a hosted rung: text only, what is left of the budget
    (False, (1, 2, 3), 60, (1, 2, 3)),  # a local seat: its budget counts the prefix itself
    (False, None, 60, None),           # tokens unknown: the seat encodes the text
])
def test_continued_request(hosted: bool, ids: tuple[int, ...] | None, max_tokens: int,
                           want_ids: tuple[int, ...] | None) -> None:
    """A continuing rung gets the same request with the text sent as its answer's start."""
    got = continued(GEN, "w0 w1 ", ids, 40, hosted)
    assert (got.prefix, got.prefix_ids, got.params.max_tokens) == ("w0 w1 ", want_ids, max_tokens)
    assert (got.messages, got.params.seed, got.request_id) == (GEN.messages, 7, "r1")
    assert continued(GEN, "x", None, 75, True).params.max_tokens == 1  # never 0 or less


@pytest.mark.parametrize(("segments", "tokenizer", "want"), [
    ([Segment("a", 2, ids=[5, 6], tokenizer="T")], "T", (5, 6)),
    ([Segment("a", 2, ids=[5, 6], tokenizer="T"), Segment("b", 1, ids=[7], tokenizer="T")],
     "T", (5, 6, 7)),
    ([Segment("a", 2, ids=[5, 6], tokenizer="T")], "U", None),      # another tokenizer
    ([Segment("h", 2, ids=None, tokenizer="")], "T", None),         # a hosted segment
    ([Segment("a", 3, ids=[5, 6], tokenizer="T")], "T", None),      # tokens missing
    ([Segment("a", 2, ids=[5, 6], tokenizer="T")], "", None),       # a hosted rung next
])
def test_prefix_ids_only_where_every_token_is_known(segments: list[Segment], tokenizer: str,
                                                    want: tuple[int, ...] | None) -> None:
    """Exact tokens pass on only between seats of one tokenizer that sent them all."""
    assert prefix_ids(segments, tokenizer) == want


HOSTED = SeatConfig(name="h", kind="openai", base_url="https://x.invalid/v1")
VLLM = SeatConfig(name="v", kind="openai", base_url="https://x.invalid/v1",
                  upstream_fields=("top_k", "min_p", "repetition_penalty"))
LOCAL = SeatConfig(name="l", model="m")
TOOLS = '[{"type": "function", "function": {"name": "f"}}]'
SCHEMA = '{"type": "json_object"}'


def _gen(chat: bool = True, **kw: object) -> Generate:
    fields = {k: kw.pop(k) for k in ("tools_json", "response_format", "tool_choice")
              if k in kw}
    return Generate("r", False, SamplingParams(**kw),  # type: ignore[arg-type]
                    messages=(ChatMessage("user", "hi"),) if chat else None,
                    prompt=None if chat else "hi", **fields)  # type: ignore[arg-type]


# (request, seat) -> the first field the rung cannot honour
UNSUPPORTED_TABLE: list[tuple[Generate, SeatConfig, str | None]] = [
    (_gen(), HOSTED, None),
    (_gen(chat=False), HOSTED, None),
    # OpenAI's own fields: every hosted rung takes them
    (_gen(presence_penalty=1.5, frequency_penalty=-0.5, seed=3, logprobs=5, temperature=0.2,
          top_p=0.9, stop=("x",)), HOSTED, None),
    (_gen(tools_json=TOOLS, tool_choice="function:f", response_format=SCHEMA), HOSTED, None),
    # neutral values set nothing
    (_gen(top_k=0, min_p=0.0, repetition_penalty=1.0), HOSTED, None),
    # the non-OpenAI fields: only where the seat says its upstream takes them
    (_gen(top_k=40), HOSTED, "top_k"),
    (_gen(top_k=40), VLLM, None),
    (_gen(min_p=0.05), HOSTED, "min_p"),
    (_gen(min_p=0.05), VLLM, None),
    (_gen(repetition_penalty=1.1), HOSTED, "repetition_penalty"),
    (_gen(repetition_penalty=0.9), VLLM, None),
    # logit_bias is in the local tokenizer's ids: no hosted rung can honour it
    (_gen(logit_bias=((5, 10.0),)), HOSTED, "logit_bias"),
    (_gen(logit_bias=((5, 10.0),)), VLLM, "logit_bias"),
    # the first field, in the table's order
    (_gen(top_k=40, min_p=0.1, logit_bias=((1, -100.0),)), HOSTED, "logit_bias"),
    (_gen(top_k=40, min_p=0.1), HOSTED, "top_k"),
    (_gen(min_p=0.1, repetition_penalty=1.2), SeatConfig(
        name="k", kind="openai", base_url="https://x.invalid/v1", upstream_fields=("min_p",)),
     "repetition_penalty"),
    # completions have no tools and no response_format upstream
    (_gen(chat=False, tools_json=TOOLS), HOSTED, "tools"),
    (_gen(chat=False, response_format=SCHEMA), HOSTED, "response_format"),
    # a local seat honours every field (or refuses the request itself)
    (_gen(top_k=40, min_p=0.1, repetition_penalty=1.3, logit_bias=((1, 5.0),)), LOCAL, None),
    (_gen(chat=False, tools_json=TOOLS, response_format=SCHEMA), LOCAL, None),
]


@pytest.mark.parametrize(("gen", "seat", "field"), UNSUPPORTED_TABLE)
def test_unsupported_names_the_first_field_a_rung_cannot_honour(
        gen: Generate, seat: SeatConfig, field: str | None) -> None:
    """A hosted rung takes OpenAI's fields, the extras its upstream_fields list, never
    logit_bias; a local seat takes everything."""
    assert unsupported(gen, seat) == field


def test_unsupported_skip_in_the_attempts_header_and_the_breaker() -> None:
    """The skip is listed as such; a hosted rung that refused a field unsent is not
    broken (its circuit is untouched)."""
    skip = Skipped(UNSUPPORTED, field="top_k")
    assert attempts_header([("h", skip), ("v", Ok())]) == "h=skipped:unsupported_field; v=ok"
    assert breaker_verdict(Failed(UNSUPPORTED, "top_k: no")) is Health.UNKNOWN


def test_a_grammar_that_gave_up_is_not_the_seats_fault() -> None:
    """llguidance giving up on one request's schema must not open the seat's circuit, or a
    client repeating a pathological schema could take the seat out of the ladder."""
    assert breaker_verdict(Failed(GRAMMAR_ERROR, "too many states")) is Health.UNKNOWN
    assert breaker_verdict(Failed("internal_error")) is Health.BROKEN
