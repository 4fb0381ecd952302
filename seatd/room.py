"""Room for seats: what a seat will hold once loaded, and which seats sleep so that an
on-demand one can load.

    estimate(config, seat) -> int                    bytes, read off its files: no loading
    budget_bytes(seatd, physical) -> int              `[seatd] memory_budget_mb`, or a share
    make_room(want, sizes, loaded, idle, budget, max_loaded) -> Room     pure

A seat's estimate is its weight files (the model's and a model drafter's safetensors)
plus the KV it may grow to (`kv_budget_mb`), or, where the seat sets one, its own
`memory_budget_mb`, which bounds all of it.  Room is judged on estimates, never on a
loaded seat's measured memory: an idle seat's KV is small now and grows with the next
long prompt.  The measure (`rss_bytes`, the backend's `loaded_bytes`) is shown beside
the estimate by `sanctum status`, `/health` and `/metrics`.

To load `want`, idle on-demand seats are put to sleep least recently used first, only
as many as it takes, and none at all when even that would not make room (then the
answer names the budget and what holds it).  A seat with rows in flight or requests
waiting is never idle; always-loaded seats are never put to sleep.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from shared.config import MEMORY_SHARE, Config, SeatConfig, SeatdConfig, resolve_path

MB = 1024 * 1024


def _weights(path: str) -> int:
    p = Path(path)
    files = sorted(p.glob("*.safetensors")) if p.is_dir() else []
    return sum(f.stat().st_size for f in files)


def _model_path(config: Config, spec: str) -> str:
    if spec.startswith("builtin:"):
        from shared.builtin import resolve_model

        return str(resolve_model(spec))
    return resolve_path(config, spec)


def estimate(config: Config, seat: SeatConfig) -> int:
    """Bytes `seat` holds once loaded and busy, read off its files (0 for a hosted seat
    or a model that cannot be found: the worker's own load says why)."""
    if seat.kind != "mlx" or not seat.model:
        return 0
    if seat.memory_budget_mb is not None:
        return seat.memory_budget_mb * MB
    try:
        total = _weights(_model_path(config, seat.model))
        if seat.drafter is not None and seat.drafter.kind == "model" and seat.drafter.path:
            total += _weights(_model_path(config, seat.drafter.path))
    except (OSError, ValueError):
        return 0
    return total + seat.kv_budget_mb * MB


def budget_bytes(seatd: SeatdConfig, physical: int) -> int:
    """What loaded seats may hold together: the config's, or MEMORY_SHARE of `physical`."""
    if seatd.memory_budget_mb:
        return seatd.memory_budget_mb * MB
    return int(physical * MEMORY_SHARE)


def physical_memory() -> int:
    import psutil

    return int(psutil.virtual_memory().total)


@dataclass(frozen=True)
class Room:
    fits: bool
    victims: tuple[str, ...] = ()  # put to sleep first, least recently used first
    held: int = 0  # bytes the seats staying loaded hold (estimates)
    need: int = 0  # bytes `want` needs


def make_room(want: str, sizes: Mapping[str, int], loaded: Sequence[str],
              idle: Sequence[str], budget: int, max_loaded: int = 0) -> Room:
    """Whether `want` can load beside `loaded` within `budget` bytes and `max_loaded`
    seats (0: no count limit), after putting to sleep a prefix of `idle` (least recently
    used first; only loaded seats other than `want` are taken)."""
    stay = [n for n in loaded if n != want]
    held = sum(sizes.get(n, 0) for n in stay)
    need = sizes.get(want, 0)

    def fits() -> bool:
        return held + need <= budget and (max_loaded == 0 or len(stay) + 1 <= max_loaded)

    victims: list[str] = []
    for name in idle:
        if fits():
            break
        if name == want or name not in stay:
            continue
        victims.append(name)
        stay.remove(name)
        held -= sizes.get(name, 0)
    if not fits():
        return Room(False, (), sum(sizes.get(n, 0) for n in loaded if n != want), need)
    return Room(True, tuple(victims), held, need)


def no_room_message(want: str, room: Room, budget: int, max_loaded: int,
                    loaded: Mapping[str, int]) -> str:
    """What a request that cannot load `want` is told: the budget, what holds it."""
    held = ", ".join(f"{n} {b / MB:.0f} MB" for n, b in loaded.items()) or "none"
    limit = f"memory budget {budget / MB:.0f} MB"
    if max_loaded:
        limit += f", at most {max_loaded} loaded"
    return (f"seat {want!r} ({room.need / MB:.0f} MB) cannot load: {limit}; loaded and "
            f"busy or always loaded: {held}; retry shortly")


def check(config: Config, physical: int) -> tuple[list[str], list[str]]:
    """`sanctum check`'s lines on memory: each local seat's estimate against the budget,
    and the errors: an always-loaded set over the budget or `max_loaded`, or an
    on-demand seat that could never load beside it."""
    budget = budget_bytes(config.seatd, physical)
    seats = config.supervised_seats
    sizes = {s.name: estimate(config, s) for s in seats}
    always = [s.name for s in seats if not s.on_demand]
    held = sum(sizes[n] for n in always)
    max_loaded = config.seatd.max_loaded
    source = "memory_budget_mb" if config.seatd.memory_budget_mb else \
        f"{MEMORY_SHARE:.0%} of {physical / MB:.0f} MB"
    lines = [f"memory budget {budget / MB:.0f} MB ({source})"
             + (f", at most {max_loaded} loaded" if max_loaded else "")]
    for s in seats:
        how = "on demand, keep_alive " + (
            "never" if s.keep_alive < 0 else f"{s.keep_alive:g}s") if s.on_demand else "always"
        lines.append(f"  {s.name:<16}{sizes[s.name] / MB:>9.0f} MB estimated  ({how})")
    errors = []
    if held > budget:
        errors.append(f"always-loaded seats ({', '.join(always)}) are estimated at "
                      f"{held / MB:.0f} MB, over the memory budget of {budget / MB:.0f} MB "
                      "(make some load = \"on_demand\", lower kv_budget_mb, or raise "
                      "[seatd] memory_budget_mb)")
    if max_loaded and len(always) > max_loaded:
        errors.append(f"{len(always)} always-loaded seats, over [seatd] max_loaded = "
                      f"{max_loaded}")
    for s in seats:
        if s.on_demand and held <= budget and not make_room(
                s.name, sizes, always, (), budget, max_loaded).fits:
            errors.append(f"on-demand seat {s.name!r} ({sizes[s.name] / MB:.0f} MB) can never "
                          f"load beside the always-loaded seats within the budget")
    return lines, errors
