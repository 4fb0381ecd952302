"""seatd's own lifetime totals per seat: what only the supervisor can count.

The worker counts what it serves (seatd/counters.py); a worker cannot count its
own restarts.  These survive seatd restarts the same way: written atomically
(write, then rename) after every change and read back at start, so they never
go backwards.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from shared.private_files import write_private


@dataclass(frozen=True)
class Totals:
    restarts: int = 0
    memory_restarts: int = 0


def path_for(state_dir: Path, seat: str) -> Path:
    return state_dir / f"seatd-{seat}.json"


def load(path: Path) -> Totals:
    """The saved totals, or zeros when there are none or they cannot be read."""
    try:
        raw = json.loads(path.read_text())
        return Totals(int(raw.get("restarts", 0)), int(raw.get("memory_restarts", 0)))
    except (OSError, ValueError, TypeError, AttributeError):
        return Totals()


def save(path: Path, totals: Totals) -> None:
    write_private(path, json.dumps(asdict(totals)))
