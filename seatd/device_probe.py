"""Whether the device still computes, after a step of the seat's failed.

A step fails for reasons of its own (a prefill out of memory, a row's bad shape) and the
seat goes on: the rows it held end with the error, the others decode.  But some device
errors stay: after CUDA's "an illegal memory access was encountered" every later call
of the process fails, and a seat that went on would fail every request it is given,
for ever, while its heartbeat said it was up.  Measured on an H100, four servers of the
8B-shape target on one card ran it out of memory at 16 clients; the seats answered
every later request of the run with a failure.  So after a failed step the engine asks
the device for a small computation it knows the answer to (`probe`); where that fails
too, the device is lost to this process: the engine ends every row it holds with the
error and tells the worker (`seatd.batch.Engine.on_device_lost`), which exits with
`shared.exitcodes.DEVICE_LOST` for seatd to start a fresh process (a restart, with its
backoff, not FATAL: a new process gets a new device context).

    probe()             raises where the device does not compute 1 + 2 * [0, 1, 2, 3]
    broken(probe) -> the probe's error, or None where it computed
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

WANT = 16.0  # sum(1 + 2 * [0, 1, 2, 3])


def probe() -> None:
    """A small computation on the default device, evaluated and checked."""
    total = (1 + 2 * mx.arange(4, dtype=mx.float32)).sum()
    mx.eval(total)
    got = total.item()
    if got != WANT:
        raise RuntimeError(f"the device computed {got!r} for {WANT}")


def broken(check: Callable[[], None] = probe) -> BaseException | None:
    """The error `check` raised, or None where it ran."""
    try:
        check()
    except Exception as exc:
        return exc
    return None
