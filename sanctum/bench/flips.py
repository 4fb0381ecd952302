"""Float flips: where a speculative answer leaves the plain one, and why.

A seeded (or temperature-0) answer is the same with speculation on or off, except
where float32 rounding differs between forward widths: the plain path scores one
token per forward, a verify block scores k+1, and the kernels sum in another order.
When the top two scores of a position sit closer together than that rounding, the
token can flip, and the rest of the answer follows a different path.

This is a correctness measure, not a speed comparison, so nothing is interleaved:
each case decodes one prompt in this process with `seatd.decode.decode`, plainly and
speculatively, and compares the token ids.  Per case it records the first position
where they differ (or none), the tokens compared (up to and including that position,
or the whole answer), and, for every position compared, the logits of both paths
(`LogitsTap`): the largest difference between them and the smallest margin between
the top two scores.  At a flip that margin against that difference is the
explanation.

Pure pieces (`first_difference`, `compared_tokens`, `per_thousand`, `top2_margin`,
`answer_positions`) have table-driven tests; the rest loads models.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from sanctum.bench.options import Options, machine
from sanctum.bench.results import Run

# -- pure figures --------------------------------------------------------------------


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first answer position where two token sequences differ, or None.

    A sequence that ends where the other goes on differs there: it stopped (end of
    text) where the other drew a token.  Two answers of equal length and equal tokens
    do not differ."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    if len(a) != len(b):
        return min(len(a), len(b))
    return None


def compared_tokens(a: Sequence[int], b: Sequence[int]) -> int:
    """Positions compared: up to and including the first difference, else the answer."""
    first = first_difference(a, b)
    return len(a) if first is None else first + 1


def per_thousand(flips: int, compared: int) -> float:
    """Flips per 1,000 tokens compared (0 when nothing was compared)."""
    return 1000.0 * flips / compared if compared > 0 else 0.0


def rate_text(flips: int, compared: int) -> str:
    """Flips per 1,000 as the report writes it; with none seen, also the 95% upper bound
    (the rule of three: fewer than 3 / n per token after n clean tokens)."""
    text = f"{per_thousand(flips, compared):.2g} ({flips} in {compared} tokens"
    if flips == 0 and compared > 0:
        text += f"; below {3000 / compared:.2g} at 95%"
    return text + ")"


def top2_margin(scores: np.ndarray) -> float | None:
    """The gap between the best and second-best finite score of one position; None when
    fewer than two tokens are left (a filter kept one: no near-tie can flip it)."""
    finite = scores[np.isfinite(scores)]
    if finite.size < 2:
        return None
    top = np.partition(finite, finite.size - 2)[-2:]
    return float(top[1] - top[0])


def answer_positions(offset: int, width: int, n_prompt: int) -> list[tuple[int, int]]:
    """(row, answer position) of a forward of `width` tokens fed at cache offset
    `offset`: row j scores the token after absolute position offset + j, which is answer
    position offset + j + 1 - n_prompt; rows inside the prompt are left out."""
    first = n_prompt - 1 - offset
    return [(j, offset + j + 1 - n_prompt) for j in range(max(0, first), width)]


def summarize_cases(rows: Sequence[FlipRow]) -> tuple[int, int, float]:
    """(flips, tokens compared, flips per 1,000) over several cases."""
    flips = sum(1 for r in rows if r.first_diff is not None)
    compared = sum(r.compared for r in rows)
    return flips, compared, per_thousand(flips, compared)


# -- what a case records --------------------------------------------------------------


class FlipRow(msgspec.Struct, frozen=True):
    """One prompt decoded plainly and speculatively, compared token by token."""

    model: str
    workload: str
    rule: str  # "greedy" (t=0) or "keyed" (seeded, t>0)
    temperature: float
    config: str  # "d3", "adaptive"
    tokens_plain: int
    tokens_spec: int
    first_diff: int | None  # answer position, None: equal answers
    compared: int
    accept_len: float  # accepted drafts per verify in the speculative answer
    # Over the positions compared (both paths scored the same context there):
    max_logit_diff: float  # largest |logit plain - logit speculative|
    min_margin: float | None  # smallest top-two gap of the plain path's scores
    min_margin_at: int | None
    # At the first difference (None without one):
    width: int | None = None  # tokens in the speculative forward that scored it
    logit_diff: float | None = None  # max |logit difference| over the vocabulary
    score_diff: float | None = None  # the same on the compared (filtered, perturbed) scores
    margin_plain: float | None = None  # top-two gap of the plain path's scores there
    margin_spec: float | None = None
    token_plain: int | None = None
    token_spec: int | None = None
    seconds: float = 0.0


# -- recording the logits of every answer position ------------------------------------


def _offset(cache: Sequence[Any] | None) -> int | None:
    for c in cache or ():
        off = getattr(c, "offset", None)
        if isinstance(off, int):
            return off
    return None


class LogitsTap:
    """The target model, keeping the logits row that scored each answer position.

    The row kept for a position is the last one computed for it: a verify block also
    scores positions after a rejected draft (with a wrong context), and a later forward
    scores them again, with the context the answer really has.  Everything else goes
    to the model unchanged (attributes too), so the decode loop computes exactly what
    it computes without the tap."""

    def __init__(self, model: Any, n_prompt: int) -> None:
        self._model = model
        self.n_prompt = n_prompt
        self.rows: dict[int, tuple[int, Any]] = {}  # position -> (forward width, logits)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __call__(self, x: Any, cache: Any = None, **kwargs: Any) -> Any:
        offset = _offset(cache)
        out = self._model(x, cache=cache, **kwargs)
        if offset is not None:
            width = int(x.shape[1])
            for j, pos in answer_positions(offset, width, self.n_prompt):
                self.rows[pos] = (width, out[0, j])
        return out

    def row(self, position: int) -> tuple[int, np.ndarray]:
        width, logits = self.rows[position]
        return width, np.array(logits.astype(_mx().float32))


def _mx() -> Any:
    import mlx.core as mx

    return mx


# -- running the cases ------------------------------------------------------------------


@dataclass
class Case:
    model: str
    workload: str
    prompt_ids: list[int]
    temperature: float
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None


def _scores(logits: np.ndarray, case: Case, position: int, width: int) -> np.ndarray:
    """What the decode loop takes the argmax of: logits at t=0, else the keyed rule's
    filtered logits plus its noise for this position."""
    if case.temperature == 0:
        return logits
    mx = _mx()
    from seatd.sampling import Keyed
    from shared.protocol import SamplingParams

    params = SamplingParams(temperature=case.temperature, top_p=case.top_p,
                            top_k=case.top_k, seed=case.seed)
    assert case.seed is not None
    keyed = Keyed(case.seed, width)
    return np.array(keyed.scores(mx.array(logits), params, position))


def compare(case: Case, config: str, plain: LogitsTap, plain_ids: list[int],
            spec: LogitsTap, spec_ids: list[int], accept_len: float, width: int,
            seconds: float) -> FlipRow:
    """The figures of one case from the two answers and their recorded logits."""
    first = first_difference(plain_ids, spec_ids)
    compared = compared_tokens(plain_ids, spec_ids)
    max_diff, min_margin, min_at = 0.0, math.inf, None
    for pos in range(compared):
        if pos not in plain.rows or pos not in spec.rows:
            continue  # the last position of an answer that stopped at end of text
        _, a = plain.row(pos)
        _, b = spec.row(pos)
        max_diff = max(max_diff, float(np.max(np.abs(a - b))))
        m = top2_margin(_scores(a, case, pos, width))
        if m is not None and m < min_margin:
            min_margin, min_at = m, pos
    extra: dict[str, Any] = {}
    if first is not None and first in plain.rows and first in spec.rows:
        _, a = plain.row(first)
        w, b = spec.row(first)
        sa, sb = _scores(a, case, first, width), _scores(b, case, first, width)
        both = np.isfinite(sa) & np.isfinite(sb)
        extra = dict(width=w, logit_diff=float(np.max(np.abs(a - b))),
                     score_diff=float(np.max(np.abs(sa[both] - sb[both]))),
                     margin_plain=top2_margin(sa), margin_spec=top2_margin(sb),
                     token_plain=int(np.argmax(sa)), token_spec=int(np.argmax(sb)))
    return FlipRow(case.model, case.workload, "greedy" if case.temperature == 0 else "keyed",
                   case.temperature, config, len(plain_ids), len(spec_ids), first, compared,
                   accept_len, max_diff, None if min_at is None else min_margin, min_at,
                   seconds=seconds, **extra)


# Round times as this CPU measures the demo pair (plain 50 ms, a verify about one step
# and 8 ms per drafter token) and the seat's prior acceptance: the per-round policy an
# adaptive seat hands a request, fixed so the run reads no clock.
ADAPTIVE_SECONDS = tuple([0.050] + [0.055 + 0.008 * k for k in range(1, 7)])
ADAPTIVE_PRIOR = (0.6,) * 6


def speculation(drafter_model: Any, config: str) -> Any:
    from seatd.adaptive import MAX_DEPTH, DepthStats, RoundPolicy
    from seatd.drafters import ModelDrafter
    from seatd.engine_types import Speculation

    if config == "adaptive":
        return Speculation(ModelDrafter(drafter_model), MAX_DEPTH, DepthStats(),
                           policy=RoundPolicy(ADAPTIVE_SECONDS, ADAPTIVE_PRIOR))
    return Speculation(ModelDrafter(drafter_model), int(config.removeprefix("d")),
                       DepthStats())


def run_case(loaded: Any, drafter_model: Any, case: Case, configs: Sequence[str],
             tokens: int, width: int) -> list[FlipRow]:
    """Decode `case` plainly once and speculatively once per config; compare each."""
    from seatd.decode import decode
    from shared.protocol import SamplingParams

    # A t=0 request is greedy whatever its other fields; a seeded one samples by key.
    params = SamplingParams(temperature=case.temperature, top_p=case.top_p, top_k=case.top_k,
                            max_tokens=tokens, seed=case.seed)
    n = len(case.prompt_ids)

    def go(spec: Any) -> tuple[LogitsTap, Any]:
        tap = LogitsTap(loaded.model, n)
        out = decode(tap, loaded.tokenizer, case.prompt_ids, params, kv="fp16",
                     context_length=loaded.context_length, spec=spec, width=width)
        return tap, out

    plain_tap, plain = go(None)
    rows = []
    for config in configs:
        t0 = time.perf_counter()
        tap, out = go(speculation(drafter_model, config))
        seconds = time.perf_counter() - t0
        rep = out.speculation
        accept = rep.accepted_tokens / rep.drafts if rep.drafts else 0.0
        rows.append(compare(case, config, plain_tap, plain.token_ids, tap, out.token_ids,
                            accept, width, seconds))
    return rows


def run_flips(models: Sequence[str], drafter: str, cases_for: Callable[[Any, str], list[Case]],
              configs: Sequence[str], tokens: int,
              progress: Callable[[FlipRow], None] | None = None) -> list[FlipRow]:
    """Every case of every model, each against every speculative config."""
    from seatd.engine_types import output_width
    from seatd.model_load import load_for_compute
    from shared.builtin import resolve_model

    draft = load_for_compute(resolve_model(drafter))
    rows: list[FlipRow] = []
    for spec in models:
        loaded = load_for_compute(resolve_model(spec))
        width = output_width(loaded.model)
        for case in cases_for(loaded, spec):
            for row in run_case(loaded, draft.model, case, configs, tokens, width):
                rows.append(row)
                if progress is not None:
                    progress(row)
    return rows


# -- the comparison: `sanctum bench run flips` ---------------------------------------------

HYBRID = "builtin:demo-hybrid"
CONFIGS = ("d3", "adaptive")
KEYED_T, KEYED_TOP_P, KEYED_TOP_K, KEYED_SEED = 0.7, 0.9, 20, 1


def cases(loaded: Any, model: str, names: Sequence[str], tokens: int) -> list[Case]:
    """The held-out workloads as prompts, each greedy (t=0) and keyed (seeded, t=0.7)."""
    from sanctum.bench.workloads import build_workloads, heldout_files
    from shared.prompt import prompt_ids
    from shared.protocol import ChatMessage

    tok = loaded.tokenizer
    _, files = heldout_files()
    cap = max(256, loaded.context_length - tokens - 64)
    out = []
    for w in build_workloads(files, lambda s: len(tok.encode(s)), cap):
        if names and w.name not in names:
            continue
        if w.kind == "chat":
            ids = prompt_ids(tok, tuple(ChatMessage(r, c) for r, c in w.messages))
        else:
            ids = prompt_ids(tok, prompt=w.prompt)
        out.append(Case(model, w.name, ids, 0.0))
        out.append(Case(model, w.name, ids, KEYED_T, KEYED_TOP_P, KEYED_TOP_K, KEYED_SEED))
    return out


def flips(opts: Options) -> Run:
    import sys

    from sanctum.bench.runner import new_run_id

    models = [opts.model] + ([HYBRID] if opts.model == Options().model else [])
    started = time.perf_counter()

    def show(r: FlipRow) -> None:
        if opts.verbose:
            where = "no difference" if r.first_diff is None else f"differ at {r.first_diff}"
            print(f"  {r.model:<20} {r.workload:<11} {r.rule:<6} {r.config:<8} "
                  f"{r.compared:>4} compared, {where}, max |dlogit| {r.max_logit_diff:.2g}, "
                  f"min margin {r.min_margin or 0:.2g}  ({r.seconds:.1f} s)",
                  file=sys.stderr, flush=True)

    rows = run_flips(models, opts.drafter,
                     lambda loaded, m: cases(loaded, m, opts.workloads, opts.flip_tokens),
                     CONFIGS, opts.flip_tokens, progress=show)
    elapsed = time.perf_counter() - started
    descriptions = {"plain": "seatd.decode.decode without speculation (one token per forward)",
                    "d3": "the same with the demo drafter, draft depth pinned at 3 (verify "
                    "forwards of 4 tokens)",
                    "adaptive": "the same with the per-round adaptive depth (0 to 6: plain "
                    "bursts and verify forwards of 2 to 7 tokens), the demo pair's round "
                    "times fixed so the run reads no clock"}
    notes = [f"Held-out workloads (tests/data/heldout), {opts.flip_tokens} new tokens per "
             "answer, in this process, fp16 KV lane; greedy at t=0, and keyed at "
             f"t={KEYED_T:g} with top_p {KEYED_TOP_P:g}, top_k {KEYED_TOP_K}, seed "
             f"{KEYED_SEED}.",
             f"The whole run took {elapsed:.0f} s."]
    from sanctum.bench.results import ArmInfo

    return Run(new_run_id(), "flips", "Speculative against plain answers, token by token",
               "plain", [ArmInfo(n, d) for n, d in descriptions.items()],
               {r.workload: r.workload for r in rows}, 1, 0, 0,
               machine(" + ".join(models)), [], notes,
               extra={"flips": msgspec.to_builtins(rows), "tokens": opts.flip_tokens})


# -- its section of the report --------------------------------------------------------------


def stored_rows(run: Run) -> list[FlipRow]:
    return msgspec.convert(run.extra.get("flips", []), list[FlipRow])


def _g(x: float | None) -> str:
    return "-" if x is None else f"{x:.2g}"


def groups(rows: Sequence[FlipRow]) -> list[tuple[tuple[str, str, str], list[FlipRow]]]:
    """Rows by (model, rule, config), in the order they ran.  Pure."""
    out: dict[tuple[str, str, str], list[FlipRow]] = {}
    for r in rows:
        out.setdefault((r.model, f"{r.rule} t={r.temperature:g}", r.config), []).append(r)
    return list(out.items())


def headline(run: Run) -> list[tuple[str, str]]:
    """(what, figure) per model, rule and config: flips per 1,000 tokens compared."""
    out = []
    for (model, rule, config), rows in groups(stored_rows(run)):
        n, compared, _ = summarize_cases(rows)
        out.append((f"flips per 1,000 tokens, {model.removeprefix('builtin:')} {rule} "
                    f"{config}", rate_text(n, compared)))
    return out


def section(run: Run, title: str) -> list[str]:
    rows = stored_rows(run)
    m = run.machine
    lines = [f"## {title}", "",
             f"{run.title}. Run `{run.run_id}`, {m.get('date', '?')}, models "
             f"`{m.get('model', '?')}` with `builtin:demo-drafter`. A correctness measure, "
             "not a speed comparison: nothing is interleaved. Each prompt is decoded once "
             "plainly and once per speculative set-up, and the token ids compared; a flip "
             "is the first position where they differ (the answers part there, so only the "
             "first counts), and the tokens compared run up to it or over the whole "
             "answer. At every position compared both paths scored the same context, so "
             "their logits can be set side by side: the largest difference between them "
             "and the smallest gap between the best two scores (the scores the token is "
             "the argmax of: logits at t=0; filtered logits plus the keyed Gumbel noise "
             "above 0) say how close the answer came to a flip. A flip needs a gap below "
             "the difference in scores (the logit difference over the temperature; the "
             "noise is the same on both paths), so the gap over that difference is the "
             "headroom left.", ""]
    lines += [f"- **{a.name}**: {a.description}" for a in run.arms]
    lines += ["", *[f"- {n}" for n in run.notes], ""]
    lines += ["| model | rule | speculative | answers | flips | tokens compared "
              "| flips per 1,000 | largest logit difference | smallest top-two gap "
              "| gap over score difference |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for (model, rule, config), rs in groups(rows):
        n, compared, _ = summarize_cases(rs)
        gaps = [r.min_margin for r in rs if r.min_margin is not None]
        diff = max(r.max_logit_diff for r in rs)
        gap = min(gaps) if gaps else None
        # Scores are logits over the temperature (plus noise that both paths share).
        t = rs[0].temperature
        score_diff = diff / t if t > 0 else diff
        headroom = "-"
        if gap is not None and score_diff > 0:
            x = gap / score_diff
            headroom = f"{x:,.0f}x" if x >= 10 else f"{x:.2g}x"
        lines.append(f"| {model} | {rule} | {config} | {len(rs)} | {n} | {compared} "
                     f"| {rate_text(n, compared)} | {_g(diff)} | {_g(gap)} | {headroom} |")
    lines += ["", "Per answer (first difference: the answer position, from 0; at it, the "
              "width of the speculative forward that scored it, the largest logit "
              "difference there and the top-two gap of each path's scores):", "",
              "| model | workload | rule | speculative | tokens plain / speculative "
              "| accepted per verify | first difference | tokens compared "
              "| largest logit difference | smallest top-two gap (at) | at the difference |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        at = "-"
        if r.first_diff is not None:
            at = (f"width {r.width}, logit difference {_g(r.logit_diff)}, gap plain "
                  f"{_g(r.margin_plain)} / speculative {_g(r.margin_spec)}, token "
                  f"{r.token_plain} / {r.token_spec}")
        closest = "-" if r.min_margin is None else f"{r.min_margin:.2g} ({r.min_margin_at})"
        lines.append(f"| {r.model.removeprefix('builtin:')} | {r.workload} "
                     f"| {r.rule} t={r.temperature:g} | {r.config} "
                     f"| {r.tokens_plain} / {r.tokens_spec} | {r.accept_len:.2f} "
                     f"| {'none' if r.first_diff is None else r.first_diff} | {r.compared} "
                     f"| {_g(r.max_logit_diff)} | {closest} | {at} |")
    return [*lines, ""]
