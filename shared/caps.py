"""Prompt caps across layers: pure arithmetic and the consistency check.

    layer   cap                                   who enforces it
    proxy   seat cap - margin (or set lower)      proxyd, with the seat's own tokenizer
    seat    max_prompt_tokens                     the worker, exactly, before prefill
    model   context length (max_position_embeddings)

A prompt is admitted to a rung when `tokens <= proxy cap`.  No layer truncates.
Hosted rungs have no local tokenizer: the proxy bounds their count from above by
the prompt's UTF-8 bytes (a byte-level BPE token is at least one byte) and holds
back a larger margin.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

DEFAULT_CAP = 65536
# Messages add template tokens that bytes of content do not show; bound them too.
HOSTED_TOKENS_PER_MESSAGE = 16


def default_seat_cap(context_length: int) -> int:
    """65,536 where the model allows it, else the context less room for an answer."""
    room = min(1024, context_length // 4)
    return max(1, min(DEFAULT_CAP, context_length - room))


def proxy_cap(seat_cap: int, margin: int, explicit: int | None = None) -> int:
    cap = seat_cap - margin
    return cap if explicit is None else min(cap, explicit)


def admits(tokens: int, cap: int) -> bool:
    return tokens <= cap


@dataclass(frozen=True)
class Verdict:
    """One rung's admission of one prompt: the proxy's count against the proxy's cap."""

    tokens: int | None  # None: not counted here (no tokenizer)
    cap: int | None  # the proxy's cap for this rung
    seat_cap: int | None
    margin: int
    # False: `tokens` is an upper bound (shared.prompt.prompt_bound) that already fits
    # the cap; the exact count is only taken when the bound does not prove the fit
    exact: bool = True

    @property
    def admitted(self) -> bool:
        return self.tokens is None or self.cap is None or admits(self.tokens, self.cap)


def hosted_estimate(texts: list[str]) -> int:
    """An upper bound on the tokens of a prompt for a tokenizer we do not have."""
    return sum(len(t.encode("utf-8")) for t in texts) + HOSTED_TOKENS_PER_MESSAGE * len(texts)


def seat_refusal(tokens: int, seat_cap: int, context_length: int) -> str | None:
    """Which limit a seat hits for a prompt of `tokens`: None, `seat_cap` or `model_context`."""
    if tokens > seat_cap:
        return "seat_cap"
    if tokens >= context_length:
        return "model_context"
    return None


def model_context(model_dir: Path) -> int:
    """The context length a model directory declares, without loading weights."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    for source in (config, config.get("text_config") or {}):
        for key in ("max_position_embeddings", "max_sequence_length", "n_positions"):
            if source.get(key):
                return int(source[key])
    raise ValueError(f"{model_dir}/config.json declares no context length")


@dataclass(frozen=True)
class Refusals:
    """Count, median and maximum prompt length of refused prompts (a bounded sample)."""

    count: int
    median: int
    max: int


def summarise(count: int, sample: list[int]) -> Refusals:
    if not sample:
        return Refusals(count, 0, 0)
    ordered = sorted(sample)
    return Refusals(count, ordered[len(ordered) // 2], ordered[-1])
