"""Turn boundaries: where chat messages start in a prompt."""

from __future__ import annotations

import pytest
from mlx_lm.utils import load_tokenizer

from seatd.turns import turn_cuts, turn_marks
from shared.builtin import resolve_model


@pytest.mark.parametrize(("prompt", "marks", "cuts"), [
    ([1, 5, 6, 2, 1, 7, 2, 1, 9], frozenset({1}), (4, 7)),  # the first message is no cut
    ([5, 6, 7], frozenset({1}), ()),
    ([1, 5, 1], frozenset(), ()),  # a tokenizer without message markers
    ([1, 5, 3, 6], frozenset({1, 3}), (2,)),
])
def test_turn_cuts(prompt: list[int], marks: frozenset[int], cuts: tuple[int, ...]) -> None:
    assert turn_cuts(prompt, marks) == cuts


def test_the_demo_chat_template_opens_messages_with_a_marker() -> None:
    tok = load_tokenizer(resolve_model("builtin:demo"))
    marks = turn_marks(tok)
    ids = list(tok.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
         {"role": "user", "content": "again"}], add_generation_prompt=True))
    cuts = turn_cuts(ids, marks)
    assert len(cuts) == 3 and ids[cuts[-1] + 1:] == tok.encode("assistant\n")
