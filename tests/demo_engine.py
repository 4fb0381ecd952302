"""A batch engine on the packaged demo model, driven by a test's own thread."""

from __future__ import annotations

from collections.abc import Callable

from seatd.batch import Engine
from seatd.engine_io import Outbox
from seatd.engine_types import output_width
from seatd.kv_budget import KVBudget


def demo_engine(on_event: Callable[[], None], max_batch: int = 4) -> Engine:
    """The demo model's engine (1 GiB of KV), its outbox calling `on_event` as it fills."""
    from seatd.model_load import load_for_compute
    from shared.builtin import resolve_model

    target = load_for_compute(resolve_model("builtin:demo"), None)
    return Engine(target.model, target.tokenizer, target.context_length,
                  output_width(target.model), max_batch, KVBudget(1 << 30),
                  outbox=Outbox(on_event))
