"""Prompt admission: count a request's tokens with each rung's own tokenizer.

Local rungs: the tokenizer of the seat's model directory (loaded once, without
the weights), the same template path the seat uses (`shared.prompt`).  Hosted
rungs: an upper bound from the prompt's bytes (`shared.caps.hosted_estimate`).
A seat whose tokenizer cannot be loaded here is admitted unchecked: the seat
still checks exactly before prefill, and `sanctum check` reports the model.
A continued answer (`Generate.prefix`) is counted with its prefix: the longer
prompt is admitted again, by the same rule, for every rung that may continue it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import structlog

from shared import caps
from shared.builtin import resolve_model, tokenizer_hash
from shared.caps import Verdict
from shared.config import Config, SeatConfig, resolve_path
from shared.errors import BadRequest
from shared.model_trust import trust_refusal
from shared.prompt import load_tokenizer, prompt_bound, prompt_ids
from shared.protocol import Generate

log = structlog.get_logger()


class Admission:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.dirs: dict[str, Path] = {}
        self.contexts: dict[str, int] = {}
        self.hashes: dict[str, str] = {}
        self._loading: dict[Path, asyncio.Task[Any]] = {}

    async def start(self) -> None:
        for seat in self.config.local_seats:
            assert seat.model is not None
            untrusted = trust_refusal(self.config, seat)
            if untrusted is not None:  # its code must not run here either; seatd refuses it
                log.warning("tokenizer_untrusted", seat=seat.name, reason=untrusted)
                continue
            try:
                path = resolve_model(resolve_path(self.config, seat.model))
                self.contexts[seat.name] = caps.model_context(path)
                self.hashes[seat.name] = tokenizer_hash(path)
            except (OSError, ValueError) as exc:
                log.warning("tokenizer_unavailable", seat=seat.name, error=str(exc),
                            note="prompts for this seat are checked by the seat alone")
                continue
            self.dirs[seat.name] = path
            if path not in self._loading:
                self._loading[path] = asyncio.create_task(
                    asyncio.to_thread(load_tokenizer, path, seat.trust_remote_code))

    async def loaded(self) -> None:
        """Once every tokenizer has loaded (or failed to)."""
        await asyncio.gather(*self._loading.values(), return_exceptions=True)

    async def stop(self) -> None:
        for task in self._loading.values():
            task.cancel()
        await asyncio.gather(*self._loading.values(), return_exceptions=True)

    async def _tokenizer(self, seat: str) -> Any | None:
        path = self.dirs.get(seat)
        if path is None:
            return None
        try:
            return await self._loading[path]
        except Exception as exc:  # a broken tokenizer must not break the proxy
            log.warning("tokenizer_load_failed", seat=seat, error=str(exc))
            self.dirs.pop(seat, None)
            return None

    async def count(self, seats: list[SeatConfig], gen: Generate) -> tuple[int, str] | None:
        """`gen`'s prompt tokens, exactly, by the tokenizer of the first of `seats` whose
        tokenizer this proxy holds, and that seat's name; else the bound of the first
        hosted one (`shared.caps.hosted_estimate`); None when there is neither."""
        for seat in seats:
            if seat.kind == "openai":
                verdict = await self.judge(seat, gen, {})
                assert verdict.tokens is not None
                return verdict.tokens, seat.name
            if gen.prompt_ids is not None:
                return len(gen.prompt_ids), seat.name
            tokenizer = await self._tokenizer(seat.name)
            if tokenizer is None:
                continue
            try:
                ids = await asyncio.to_thread(prompt_ids, tokenizer, gen.messages, gen.prompt,
                                              gen.tools_json)
            except Exception as exc:  # the chat template refused these messages
                raise BadRequest(f"the messages do not fit the model's chat template: {exc}",
                                 param="messages") from None
            return len(ids), seat.name
        return None

    def seat_cap(self, seat: SeatConfig, reported: int = 0) -> int | None:
        """The seat's own cap: what it reported at its handshake, else what config implies."""
        if reported:
            return reported
        if seat.max_prompt_tokens:
            return seat.max_prompt_tokens
        if seat.kind == "openai":
            return caps.DEFAULT_CAP
        context = self.contexts.get(seat.name)
        return caps.default_seat_cap(context) if context else None

    async def judge(self, seat: SeatConfig, gen: Generate, memo: dict[Any, int],
                    reported_cap: int = 0) -> Verdict:
        """Count `gen`'s prompt for `seat` (memoised per tokenizer) and compare with its cap."""
        p = self.config.proxy
        seat_cap = self.seat_cap(seat, reported_cap)
        if gen.prompt_ids is not None:  # counted as given, by every tokenizer alike
            cap = caps.proxy_cap(seat_cap or caps.DEFAULT_CAP, 0, seat.proxy_max_prompt_tokens)
            return Verdict(len(gen.prompt_ids), cap, seat_cap, 0)
        if seat.kind == "openai":
            key: Any = "hosted"
            if key not in memo:
                texts = [m.content for m in gen.messages] if gen.messages is not None \
                    else [gen.prompt or ""]
                # an assistant turn's calls are sent with it, and count like its text
                texts += [m.tool_calls_json for m in gen.messages or () if m.tool_calls_json]
                if gen.tools_json:
                    texts.append(gen.tools_json)
                if gen.prefix:
                    texts.append(gen.prefix)
                memo[key] = caps.hosted_estimate(texts)
            cap = caps.proxy_cap(seat_cap or caps.DEFAULT_CAP, p.hosted_margin,
                                 seat.proxy_max_prompt_tokens)
            return Verdict(memo[key], cap, seat_cap, p.hosted_margin)
        tokenizer = await self._tokenizer(seat.name)
        if tokenizer is None or seat_cap is None:
            return Verdict(None, None, seat_cap, p.tokenizer_margin)
        cap = caps.proxy_cap(seat_cap, p.tokenizer_margin, seat.proxy_max_prompt_tokens)
        key = self.dirs[seat.name]
        if key not in memo:
            # The exact count is needed only near the cap: a bound that fits proves it.
            bound_key = ("bound", key)
            if bound_key not in memo:
                try:
                    memo[bound_key] = prompt_bound(tokenizer, gen.messages, gen.prompt,
                                                   gen.tools_json) + _prefix_bound(gen)
                except Exception as exc:  # the chat template refused these messages
                    raise BadRequest("the messages do not fit the model's chat template: "
                                     f"{exc}", param="messages") from None
            if caps.admits(memo[bound_key], cap):
                return Verdict(memo[bound_key], cap, seat_cap, p.tokenizer_margin, exact=False)
            try:
                memo[key] = len(await asyncio.to_thread(
                    prompt_ids, tokenizer, gen.messages, gen.prompt, gen.tools_json)) \
                    + await asyncio.to_thread(_prefix_tokens, tokenizer, gen)
            except Exception as exc:  # the chat template refused these messages
                raise BadRequest(f"the messages do not fit the model's chat template: {exc}",
                                 param="messages") from None
        return Verdict(memo[key], cap, seat_cap, p.tokenizer_margin)


def _prefix_bound(gen: Generate) -> int:
    """A continued answer's prefix, bounded like a prompt: a token covers a byte or more."""
    if gen.prefix_ids is not None:
        return len(gen.prefix_ids)
    return len((gen.prefix or "").encode("utf-8"))


def _prefix_tokens(tokenizer: Any, gen: Generate) -> int:
    """A continued answer's prefix, counted as the seat will (seatd.worker)."""
    if gen.prefix_ids is not None:
        return len(gen.prefix_ids)
    if not gen.prefix:
        return 0
    return len(tokenizer.encode(gen.prefix, add_special_tokens=False))
