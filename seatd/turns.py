"""Turn boundaries in a prompt: where a chat message starts.

The prompt cache keeps a prompt where the next turn of the same conversation will pass
again: at the start of the last message of a prompt (with ChatML, the `<|im_start|>` of
the generation prompt), which is the start of the assistant's answer in the next turn.
(A hybrid model's recurrent state can only be resumed at the exact length it was saved
at; attention KV could be cut anywhere, but a short chat never reaches the prefill
grid.)  Prefill cuts its chunks at every turn boundary, warm or cold, so a request
resumed at one computes the rest in exactly the chunks a cold one would.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# Special tokens that open a chat message in the templates mlx-lm models ship with.
TURN_MARKERS = ("<|im_start|>", "<|start_header_id|>", "<start_of_turn>")


def turn_marks(tokenizer: Any) -> frozenset[int]:
    """Ids of the tokenizer's message-opening special tokens (empty when it has none)."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    return frozenset(vocab[m] for m in TURN_MARKERS if m in vocab)


def turn_cuts(prompt: Sequence[int], marks: frozenset[int]) -> tuple[int, ...]:
    """Positions (after the first) where a message starts, in order."""
    if not marks:
        return ()
    return tuple(i for i, t in enumerate(prompt) if i > 0 and t in marks)
