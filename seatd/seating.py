"""What a seat decides as its engine admits a request (`seatd.engine_io.Admission`),
on the MLX thread: where its prompt resumes from the prompt cache, and its speculation
plan from the seat's running figures.

    SeatAdmission(prompt_cache, speculation, turn_marks).admit(work) -> Admitted

Both read state that moves as the seat serves (the cache's entries, the cost model and
depth figures), so they are decided as the request begins, not as it arrives.
"""

from __future__ import annotations

from seatd.engine_io import Admitted, Work
from seatd.prompt_cache import SeatPromptCache
from seatd.speculation import SeatSpeculation
from seatd.turns import turn_cuts


class SeatAdmission:
    def __init__(self, prompt_cache: SeatPromptCache, speculation: SeatSpeculation,
                 turn_marks: frozenset[int]) -> None:
        self.prompt_cache = prompt_cache
        self.speculation = speculation
        self.turn_marks = turn_marks

    def admit(self, work: Work) -> Admitted:
        request = work.request
        spec = self.speculation.plan(request, work.kv)
        cache = self.prompt_cache
        plan = cache.begin(request, work.kv, work.prompt, request.params.max_tokens,
                           turn_cuts(work.prompt, self.turn_marks))
        return Admitted(plan.resume, spec, lambda ok: cache.finish(plan, ok))
