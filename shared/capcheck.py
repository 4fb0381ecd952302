"""`sanctum check`: every layer's cap in one table, and what disagrees.

`check(config, facts)` is pure: the model facts (context length, tokenizer
hash, the code a folder names) are read by `model_facts` and passed in, so the
rules are table-tested.

`errors` stop both daemons from starting (`preflight`); `fatal` are seats that will
be FATAL while the rest serve (a model folder naming code its seat does not trust);
`sanctum check` exits non-zero on either.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared import caps, curve
from shared.builtin import resolve_model, tokenizer_hash
from shared.config import Config, SeatConfig, resolve_path
from shared.model_trust import OwnCode, own_code, refusal


@dataclass(frozen=True)
class ModelFacts:
    context_length: int
    tokenizer_hash: str
    own_code: tuple[OwnCode, ...] = ()


@dataclass(frozen=True)
class Row:
    layer: str
    seat: str
    cap: int | None
    margin: int | None
    note: str


@dataclass(frozen=True)
class Report:
    rows: list[Row]
    errors: list[str]
    warnings: list[str]
    fatal: list[str] = field(default_factory=list)


def model_facts(config: Config, model: str) -> ModelFacts | str:
    """The facts of a model directory, or why they cannot be read."""
    try:
        path = resolve_model(resolve_path(config, model))
        return ModelFacts(caps.model_context(path), tokenizer_hash(path),
                          tuple(own_code(path)))
    except (OSError, ValueError) as exc:
        return str(exc)


def gather(config: Config) -> dict[str, ModelFacts | str]:
    facts: dict[str, ModelFacts | str] = {}
    for seat in config.local_seats:
        assert seat.model is not None
        facts[seat.model] = model_facts(config, seat.model)
        if seat.drafter is not None and seat.drafter.path:
            facts[seat.drafter.path] = model_facts(config, seat.drafter.path)
    return facts


def _trust(config: Config, seat: SeatConfig, role: str, spec: str,
           got: ModelFacts | str | None, report: Report) -> None:
    if not isinstance(got, ModelFacts) or not got.own_code or spec.startswith("builtin:"):
        return
    folder = resolve_model(resolve_path(config, spec))
    if not seat.trust_remote_code:
        report.fatal.append(f"seat {seat.name}: " + refusal(seat.name, role, folder,
                                                             list(got.own_code)))
    else:
        named = "; ".join(str(c) for c in got.own_code)
        report.warnings.append(f"seat {seat.name}: trust_remote_code = true: the {role} "
                               f"folder {folder} runs its own code ({named})")


def _local(config: Config, seat: SeatConfig, facts: dict[str, ModelFacts | str],
           report: Report) -> None:
    margin = config.proxy.tokenizer_margin
    assert seat.model is not None
    got = facts.get(seat.model)
    _trust(config, seat, "model", seat.model, got, report)
    if seat.drafter is not None and seat.drafter.path:
        _trust(config, seat, "drafter", seat.drafter.path, facts.get(seat.drafter.path), report)
    if not isinstance(got, ModelFacts):
        report.warnings.append(f"seat {seat.name}: model {seat.model!r} cannot be read "
                               f"({got}); the seat will be FATAL until it can")
        seat_cap = seat.max_prompt_tokens
        context = None
    else:
        context = got.context_length
        seat_cap = seat.max_prompt_tokens or caps.default_seat_cap(context)
    proxy = caps.proxy_cap(seat_cap, margin, seat.proxy_max_prompt_tokens) if seat_cap else None
    report.rows.append(Row("proxy", seat.name, proxy, margin,
                           "exact count with the seat's tokenizer"))
    report.rows.append(Row("seat", seat.name, seat_cap, None,
                           "max_prompt_tokens" if seat.max_prompt_tokens else "default"))
    report.rows.append(Row("model", seat.name, context, None, "context length"))
    if seat.proxy_max_prompt_tokens and seat_cap and \
            seat.proxy_max_prompt_tokens + margin > seat_cap:
        report.errors.append(
            f"seat {seat.name}: proxy cap {seat.proxy_max_prompt_tokens} plus margin {margin} "
            f"exceeds the seat's cap {seat_cap}: the proxy would admit prompts the seat refuses")
    if proxy is not None and proxy < 1:
        report.errors.append(f"seat {seat.name}: margin {margin} leaves no room under the "
                             f"seat's cap {seat_cap}")
    if seat_cap and context and seat_cap >= context:
        report.errors.append(
            f"seat {seat.name}: cap {seat_cap} is not below the model's context length "
            f"{context}: a prompt at the cap leaves no room to answer")
    if seat.drafter is not None and seat.drafter.path and isinstance(got, ModelFacts):
        d = facts.get(seat.drafter.path)
        if isinstance(d, ModelFacts) and d.tokenizer_hash != got.tokenizer_hash:
            report.warnings.append(f"seat {seat.name}: the drafter's tokenizer differs from the "
                                   "model's; speculation will decline (tokenizer_mismatch)")


def check(config: Config, facts: dict[str, ModelFacts | str]) -> Report:
    report = Report([], [], [])
    if config.proxy.tokenizer_margin < 0 or config.proxy.hosted_margin < 0:
        report.errors.append("proxy: a margin must not be negative")
    for seat in config.seat:
        if seat.kind == "mlx":
            _local(config, seat, facts, report)
        else:
            cap = seat.max_prompt_tokens or caps.DEFAULT_CAP
            margin = config.proxy.hosted_margin
            report.rows.append(Row("proxy", seat.name, caps.proxy_cap(
                cap, margin, seat.proxy_max_prompt_tokens), margin,
                "upper-bound estimate (UTF-8 bytes), no local tokenizer"))
            report.rows.append(Row("seat", seat.name, cap, None, "hosted, declared"))
            if seat.proxy_max_prompt_tokens and seat.proxy_max_prompt_tokens + margin > cap:
                report.errors.append(f"seat {seat.name}: proxy cap plus hosted margin exceeds "
                                     f"its cap {cap}")
    seats = {s.name: s for s in config.seat}
    for route in config.route:
        if not route.same_tokenizer:
            continue
        hashes: dict[str, str] = {}
        for name in route.ladder:
            seat = seats[name]
            got = facts.get(seat.model or "")
            if seat.kind == "mlx" and isinstance(got, ModelFacts):
                hashes[name] = got.tokenizer_hash
        if len(set(hashes.values())) > 1:
            detail = ", ".join(f"{n}={h[:12]}" for n, h in hashes.items())
            report.errors.append(f"route {route.model}: same_tokenizer is claimed but the "
                                 f"seats' tokenizers differ ({detail})")
    return report


def render(report: Report) -> str:
    lines = [f"{'layer':<7}{'seat':<16}{'cap':>9}{'margin':>8}  note"]
    for r in report.rows:
        cap = "-" if r.cap is None else str(r.cap)
        margin = "" if r.margin is None else str(r.margin)
        lines.append(f"{r.layer:<7}{r.seat:<16}{cap:>9}{margin:>8}  {r.note}")
    lines += [f"warning: {w}" for w in report.warnings]
    lines += [f"FATAL: {f}" for f in report.fatal]
    lines += [f"error: {e}" for e in report.errors]
    if not report.errors and not report.fatal:
        lines.append("config ok")
    else:
        lines.append(", ".join(part for part in (
            f"{len(report.errors)} error(s)" if report.errors else "",
            f"{len(report.fatal)} seat(s) FATAL" if report.fatal else "") if part))
    return "\n".join(lines)


def check_path(config: Config) -> Report:
    report = check(config, gather(config))
    report.errors.extend(curve.problems(config))  # key files: readable, secrets 0600
    return report


__all__ = ["ModelFacts", "Report", "Row", "check", "check_path", "gather", "render"]
