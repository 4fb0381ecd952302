"""The seat's decode loop: one loop for sync and streaming requests.

Streaming is this same loop emitting committed text as it goes; a sync request
collects the same pieces.  That is why streamed output equals sync output byte
for byte for the same request and seed.

The next step is scheduled (`mx.async_eval`) before the current token is read
on the host, so the model's forward overlaps the Python work between steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

from seatd.sampling import KeyChain, sample
from seatd.stops import scan_stops
from shared.protocol import SamplingParams

PREFILL_CHUNK = 512

Emit = Callable[[str, int], None]


class DecodeCancelled(Exception):
    """The request was cancelled; the loop stopped between two steps."""


@dataclass
class DecodeResult:
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


def _kv_group_size(model: Any) -> int:
    """The largest MLX quantization group that divides the head dimension."""
    args = getattr(model, "args", None)
    head_dim = getattr(args, "head_dim", None) or (
        args.hidden_size // args.num_attention_heads if args is not None else 64)
    for group in (64, 32):
        if head_dim % group == 0:
            return group
    raise ValueError(f"head dimension {head_dim} cannot hold a q8 KV cache")


def make_cache(model: Any, kv: str) -> list[Any]:
    """A fresh prompt cache for the lane's KV mode (`fp16` or `q8`)."""
    if kv == "q8":
        group = _kv_group_size(model)
        return [mlx_cache.QuantizedKVCache(group_size=group, bits=8) for _ in model.layers]
    return mlx_cache.make_prompt_cache(model)


def decode(
    model: Any,
    tokenizer: Any,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    *,
    kv: str,
    context_length: int,
    emit: Emit | None = None,
    cancelled: Callable[[], bool] = lambda: False,
    on_token: Callable[[int], None] | None = None,
) -> DecodeResult:
    """Generate for one request.  `emit(text, completion_tokens)` gets committed text."""
    cache = make_cache(model, kv)
    prompt = mx.array(list(prompt_ids), dtype=mx.uint32)
    n_prompt = len(prompt_ids)
    max_new = min(params.max_tokens, max(context_length - n_prompt, 0))
    keys = KeyChain(params.seed)
    eos = set(tokenizer.eos_token_ids)
    detok = tokenizer.detokenizer
    pieces: list[str] = []

    def send(text: str, count: int) -> None:
        if text:
            pieces.append(text)
            if emit is not None:
                emit(text, count)

    if max_new == 0:
        return DecodeResult("", "length", n_prompt, 0)

    done = 0
    while n_prompt - done > 1:
        n = min(PREFILL_CHUNK, n_prompt - done - 1)
        model(prompt[None, done : done + n], cache=cache)
        mx.eval([c.state for c in cache])
        done += n
        if cancelled():
            raise DecodeCancelled

    def step(tokens: mx.array) -> mx.array:
        logits = model(tokens[None], cache=cache)[:, -1, :]
        return sample(logits, params, keys.next())

    y = step(prompt[done:])
    mx.async_eval(y)
    pending = ""
    produced = 0
    finish = "length"
    cut = False
    while True:
        if produced + 1 < max_new:
            next_y = step(y)
            mx.async_eval(next_y)
        token = int(y.item())
        if token in eos:
            finish = "stop"
            break
        produced += 1
        if on_token is not None:
            on_token(produced)
        detok.add_token(token)
        pending += detok.last_segment
        now, pending, stopped = scan_stops(pending, params.stop)
        send(now, produced)
        if stopped:
            finish, cut = "stop", True
            break
        if produced >= max_new:
            break
        if cancelled():
            raise DecodeCancelled
        y = next_y
    if not cut:
        # Flush what the detokenizer and the stop scan held back; the stream ended.
        detok.finalize()
        pending += detok.last_segment
        now, held, stopped = scan_stops(pending, params.stop)
        if stopped:
            finish = "stop"
        send(now if stopped else now + held, produced)
    return DecodeResult("".join(pieces), finish, n_prompt, produced)
