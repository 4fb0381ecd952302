"""Room for on-demand seats, as tables: which idle seats sleep so that one can load,
what a seat is estimated at, `sanctum check`'s verdict, and when the proxy puts an
idle seat to sleep."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxyd.on_demand import sleep_reason
from seatd.room import MB, budget_bytes, check, estimate, make_room
from shared.config import Config, ConfigError, SeatdConfig, parse_config

SIZES = {"a": 40, "b": 30, "c": 50, "big": 120}

# want, loaded, idle (LRU first), budget, max_loaded -> fits, victims
ROOMS = [
    ("c", ["a", "b"], ["a", "b"], 200, 0, True, ()),             # fits as it is
    ("c", ["a", "b"], ["a", "b"], 100, 0, True, ("a",)),         # the least recently used
    ("c", ["a", "b"], ["b", "a"], 100, 0, True, ("b",)),         # LRU order is the proxy's
    ("c", ["a", "b"], ["a", "b"], 60, 0, True, ("a", "b")),      # as many as it takes
    ("c", ["a", "b"], ["b"], 70, 0, False, ()),                  # a is busy: b alone is not
    ("c", ["a", "b"], [], 100, 0, False, ()),                    # nothing idle: no room
    ("big", [], [], 100, 0, False, ()),                          # over the budget alone
    ("c", ["a", "b"], ["a", "b"], 10**6, 2, True, ("a",)),       # max_loaded, not bytes
    ("c", ["a", "b"], [], 10**6, 2, False, ()),
    ("a", ["a", "b"], ["a", "b"], 100, 2, True, ()),             # already loaded: itself
    ("c", ["a"], ["zz", "a"], 50, 0, True, ("a",)),              # unknown names passed over
]


@pytest.mark.parametrize("want, loaded, idle, budget, max_loaded, fits, victims", ROOMS)
def test_make_room(want: str, loaded: list[str], idle: list[str], budget: int,
                   max_loaded: int, fits: bool, victims: tuple[str, ...]) -> None:
    room = make_room(want, SIZES, loaded, idle, budget, max_loaded)
    assert (room.fits, room.victims) == (fits, victims)
    if fits:
        assert room.held + room.need <= budget


@pytest.mark.parametrize("keep_alive, override, idle_s, why", [
    (300.0, None, 299.0, None),
    (300.0, None, 300.0, "idle"),
    (0.0, None, 0.0, "idle"),          # keep_alive_s = 0: after each answer
    (-1.0, None, 10**9, None),         # never
    (300.0, 0.0, 0.0, "request"),      # the request's keep_alive replaces the seat's
    (300.0, 5.0, 4.0, None),
    (0.0, -1.0, 10**9, None),          # a request may keep it for ever
])
def test_sleep_reason(keep_alive: float, override: float | None, idle_s: float,
                      why: str | None) -> None:
    assert sleep_reason(keep_alive, override, idle_s) == why


def _config(tmp_path: Path, seatd: str, seats: str) -> Config:
    model = tmp_path / "m"
    model.mkdir(exist_ok=True)
    (model / "model.safetensors").write_bytes(b"\0" * (3 * MB))
    routes = '[[route]]\nmodel = "r"\nladder = ["a"]\n'
    return parse_config(f"[seatd]\n{seatd}\n{seats}{routes}", base_dir=str(tmp_path))


SEAT = '[[seat]]\nname = "{n}"\nmodel = "m"\nkv_budget_mb = 10\n{extra}\n'


def test_estimate_is_weights_and_kv_or_the_seats_own_budget(tmp_path: Path) -> None:
    cfg = _config(tmp_path, "", SEAT.format(n="a", extra="")
                  + SEAT.format(n="b", extra="memory_budget_mb = 99"))
    a, b = cfg.seat
    assert estimate(cfg, a) == 13 * MB
    assert estimate(cfg, b) == 99 * MB


def test_the_budget_is_the_configs_or_a_share_of_memory() -> None:
    assert budget_bytes(SeatdConfig(memory_budget_mb=100), 10**12) == 100 * MB
    assert budget_bytes(SeatdConfig(), 1000 * MB) == 750 * MB


@pytest.mark.parametrize("seatd, loads_, errors", [
    ("memory_budget_mb = 40", ("always", "always"), 0),             # 26 MB of 40
    ("memory_budget_mb = 20", ("always", "always"), 1),             # 26 MB over 20
    ("memory_budget_mb = 20", ("on_demand", "on_demand"), 0),       # each fits alone
    ("memory_budget_mb = 20", ("always", "on_demand"), 1),          # b never beside a
    ("max_loaded = 1", ("always", "always"), 1),
    ("max_loaded = 1", ("on_demand", "on_demand"), 0),
])
def test_check_refuses_an_always_loaded_set_that_cannot_fit(
        tmp_path: Path, seatd: str, loads_: tuple[str, str], errors: int) -> None:
    seats = "".join(SEAT.format(n=n, extra=f'load = "{load}"')
                    for n, load in zip("ab", loads_, strict=True))
    lines, found = check(_config(tmp_path, seatd, seats), 10**12)
    assert len(found) == errors, found
    assert any("13 MB estimated" in line for line in lines)


@pytest.mark.parametrize("extra, error", [
    ('keep_alive_s = 10', "only for load"),
    ('load = "on_demand"\nkeep_alive_s = -0.5', "-1 for never"),
])
def test_keep_alive_is_for_on_demand_seats(tmp_path: Path, extra: str, error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        _config(tmp_path, "", SEAT.format(n="a", extra=extra))
