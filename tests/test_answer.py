"""A continued answer: from any point where another seat stopped, the client's text goes
on exactly as one uninterrupted answer's would (seatd/answer.py)."""

from __future__ import annotations

from typing import Any

import pytest

from seatd.answer import Answer, seam
from shared.builtin import resolve_model
from shared.prompt import load_tokenizer
from shared.protocol import SamplingParams

# Spaces alone, runs of spaces, a multi-byte character and a stop string to hold back.
TEXT = "def f(x):\n    return  x + 1  # é ok\n\n\nprint( f(2) )  END tail"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(resolve_model("builtin:demo"))


@pytest.mark.parametrize(("head", "sent", "want"), [
    ("abc", "abc", ("", 0)),       # the client has all the tokens' text
    ("abc d", "abc", (" d", 0)),   # text held back (a possible stop string's start)
    ("abc", "abc ", ("", 1)),      # a lone space the detokenizer still holds was sent
    ("abc", " abc", ("", 0)),      # the leading space an answer's first text loses
    ("", "", ("", 0)),
])
def test_seam(head: str, sent: str, want: tuple[str, int]) -> None:
    """Where a continuation picks up, from the prefix's own text and what was sent."""
    assert seam(head, sent) == want


def test_seam_refuses_text_that_is_not_the_tokens() -> None:
    with pytest.raises(ValueError):
        seam("abc", "abx")


def run(tokenizer: Any, params: SamplingParams, ids: list[int], prefix: list[int],
        sent: str) -> tuple[str, list[int]]:
    """Feed `ids` after `prefix` to a continued Answer: (the text it sends, the counts)."""
    out: list[str] = []
    counts: list[int] = []

    def emit(text: str, count: int) -> None:
        out.append(text)
        counts.append(count)

    answer = Answer(tokenizer, params, 1000, emit, prefix=prefix, sent=sent)
    for token in ids:
        if answer.take(token):
            break
    answer.close()
    return "".join(out), counts


@pytest.mark.parametrize("stop", [(), ("END",)])
def test_a_continuation_from_every_point_equals_the_whole_answer(tokenizer: Any,
                                                                 stop: tuple[str, ...]) -> None:
    """For every token k of an answer, a seat given its first k tokens and the text its
    client had then sends exactly the rest: sent + continued == uninterrupted."""
    params = SamplingParams(stop=stop)
    ids = list(tokenizer.encode(TEXT, add_special_tokens=False))
    whole, _ = run(tokenizer, params, ids, [], "")
    assert whole == (TEXT.split("END")[0] if stop else TEXT)
    sent_at: list[str] = []
    sent: list[str] = []
    answer = Answer(tokenizer, params, 1000, lambda text, _: sent.append(text))
    for token in ids:
        sent_at.append("".join(sent))  # what the client had before this token
        if answer.take(token):
            break
    for k in range(1, len(sent_at)):
        rest, counts = run(tokenizer, params, ids[k:], ids[:k], sent_at[k])
        assert sent_at[k] + rest == whole, k
        # Counts are this seat's own tokens, never the prefix's.
        assert all(1 <= c <= len(ids) - k for c in counts), (k, counts)


def test_the_budget_counts_the_whole_answer(tokenizer: Any) -> None:
    """A continued answer ends at the same length as the uninterrupted one."""
    ids = list(tokenizer.encode(TEXT, add_special_tokens=False))
    answer = Answer(tokenizer, SamplingParams(), 10, None, prefix=ids[:6],
                    sent=tokenizer.decode(ids[:6]))
    taken = 0
    for token in ids[6:]:
        taken += 1
        if answer.take(token):
            break
    assert taken == 4 and answer.produced == 4 and answer.finish == "length"
    assert Answer(tokenizer, SamplingParams(), 6, None, prefix=ids[:6]).done


def test_fresh_ids_hand_out_each_token_once(tokenizer: Any) -> None:
    """The tokens a chunk carries: each answer token once, the prefix's never."""
    ids = list(tokenizer.encode(TEXT, add_special_tokens=False))
    answer = Answer(tokenizer, SamplingParams(), 1000, None, prefix=ids[:3],
                    sent=tokenizer.decode(ids[:3]))
    got: list[int] = []
    for token in ids[3:9]:
        answer.take(token)
        got.extend(answer.fresh_ids())
    assert got == ids[3:9] and answer.fresh_ids() == ()
