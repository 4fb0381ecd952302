"""The sampling rules side by side on one speculating seat: keyed, rejection, plain.

A seeded request samples by the keyed rule and keeps a draft only while it equals the
target's own keyed token; an unseeded one uses rejection sampling; either can turn
speculation off.  Per draft token, rejection sampling keeps sum(min(p, q)) = 1 - d (d
the total-variation distance between target and drafter), the keyed rule's shared noise
at least (1 - d) / (1 + d): close when the drafter is good, further apart when it is
not.  Arms (all through `sanctum up`, the demo pair, interleaved):

    keyed d3            seeded, speculation on, draft depth pinned at 3 by the request
    rejection d3        unseeded, the same seat, the same pin
    plain               seeded like keyed, speculation off by the request
    keyed adaptive      seeded, a seat of its own with the adaptive depth
    rejection adaptive  unseeded, another such seat

The pinned arms compare acceptance at one depth; the adaptive arms what a seat
actually gains with each rule (the adaptive depth follows the acceptance it sees, so
each rule gets a seat whose figures only it taught).  The k-th request of a workload
is seeded `1 + k` in every seeded arm, so keyed and plain decode the same answer
(except for a float near-tie, see `sanctum.bench.flips`) and their ratio is
speculation's alone.
"""

from __future__ import annotations

import dataclasses
import zlib
from pathlib import Path
from typing import Any

import msgspec

from sanctum.bench import arms as A
from sanctum.bench import options as O
from sanctum.bench import servers
from sanctum.bench.options import Options
from sanctum.bench.results import Run, Sample
from sanctum.bench.runner import Measure
from sanctum.bench.stats import Summary, figure_values, pair_ratios, summarize
from sanctum.bench.text import fmt_ratio, per_temperature

TEMPERATURES = (0.7, 1.0)
DEPTH = 3
PLAIN = "plain"
KEYED, REJECTION = "keyed d3", "rejection d3"
KEYED_ADAPTIVE, REJECTION_ADAPTIVE = "keyed adaptive", "rejection adaptive"
SPECULATIVE = (KEYED, REJECTION, KEYED_ADAPTIVE, REJECTION_ADAPTIVE)


class RuleArm(A.SeatSpecArm):
    """A seat's answers with the seat's acceptance counters, seeded `seed + k` for the
    k-th request of a workload (None: unseeded), with the request's own `sanctum`
    options.  Also records a checksum of each answer (`answer_crc`), so a keyed answer
    can be checked against the plain one of the same pair."""

    def __init__(self, base_url: str, seat: str, temperature: float, max_tokens: int,
                 workloads: dict[str, Any], seed: int | None,
                 sanctum: dict[str, Any]) -> None:
        super().__init__(base_url, seat, temperature, max_tokens, workloads, seed=seed)
        if sanctum:
            self.extra_body = {"sanctum": sanctum}

    def request_seed(self, k: int) -> int | None:
        return None if self.seed is None else self.seed + k

    def __call__(self, name: str) -> dict[str, float]:
        figures = super().__call__(name)
        return figures | {"answer_crc": float(zlib.crc32(self.last_text.encode()))}


def same_answers(samples: list[Sample], arm: str, other: str) -> tuple[int, int]:
    """(pairs whose answers were byte-equal, pairs compared) between two arms.  Pure."""
    groups: dict[tuple[int, str], dict[str, float]] = {}
    for s in samples:
        if not s.warmup and s.error is None and "answer_crc" in s.figures:
            groups.setdefault((s.round, s.workload), {})[s.arm] = s.figures["answer_crc"]
    pairs = [g for g in groups.values() if arm in g and other in g]
    return sum(1 for g in pairs if g[arm] == g[other]), len(pairs)


def rules(opts: Options) -> Run:
    from shared.builtin import resolve_model
    from shared.prompt import load_tokenizer

    title = "Sampling rules on one speculating seat: keyed, rejection and plain"
    try:
        drafter = resolve_model(opts.drafter)
    except ValueError as exc:
        return O.not_measurable("rules", title, f"no drafter model ({exc})", opts.model)
    if not (drafter / "config.json").exists():
        return O.not_measurable("rules", title, f"no drafter model at {opts.drafter}",
                                 opts.model)
    path = O.model_path(opts.model)
    cap = O.seat_cap(2048, opts.tokens)
    source, base = O.workloads_for(load_tokenizer(path), cap)
    base = [w for w in base if w.name in (opts.workloads or O.SPEC_WORKLOADS)]
    workloads = [dataclasses.replace(w, name=f"{w.name} t={t:g}", temperature=t)
                 for t in TEMPERATURES for w in base]
    by_name = {w.name: w for w in workloads}
    extra = f'drafter = {{ kind = "model", path = "{drafter}" }}\nspeculation = true\n'
    seats = [("rules", str(path), cap + 64, extra),
             ("adaptive-keyed", str(path), cap + 64, extra),
             ("adaptive-rejection", str(path), cap + 64, extra)]
    port = servers.free_port()
    config = servers.sanctum_config(port, seats)
    pin = {"draft_depth": DEPTH}
    with servers.sanctum_up(config, tuple(name for name, *_ in seats), port) as url:
        def arm(seat: str, seed: int | None, sanctum: dict[str, Any]) -> RuleArm:
            return RuleArm(url, seat, 0.0, opts.tokens, by_name, seed, sanctum)

        arms: dict[str, tuple[str, Measure]] = {
            KEYED: ("seeded requests (keyed rule), speculation on, draft depth 3 pinned by "
                    "the request (`sanctum.draft_depth`)", arm("rules", 1, pin)),
            REJECTION: ("unseeded requests (rejection sampling), the same seat and pin",
                        arm("rules", None, pin)),
            PLAIN: ("seeded like keyed d3, the same seat, speculation off by the request "
                    "(`sanctum.speculation = false`)", arm("rules", 1, {"speculation": False})),
            KEYED_ADAPTIVE: ("seeded requests, a seat of the same config that only they "
                             "use, adaptive draft depth", arm("adaptive-keyed", 1, {})),
            REJECTION_ADAPTIVE: ("unseeded requests, another such seat, adaptive draft "
                                 "depth", arm("adaptive-rejection", None, {})),
        }
        notes = [
            f"Workloads from {source} (the speculation comparison's), each at temperature "
            + " and ".join(f"{t:g}" for t in TEMPERATURES)
            + f", top_p and top_k off; {opts.tokens} new tokens per request.",
            "Acceptance is compared at one pinned depth (3, by the request's "
            "`sanctum.draft_depth`): a seat's adaptive depth follows the acceptance it "
            "sees, so at adaptive depth the two rules would draft at different depths and "
            "their acceptance would not compare. The adaptive arms show what each rule "
            "gains on a seat left to choose; each rule has its own seat so that neither "
            "teaches the other's depth.",
            "The k-th request of a workload is seeded 1 + k in keyed d3, plain and keyed "
            "adaptive: keyed and plain decode the same answer (the seed fixes it), so "
            "their ratio is speculation's alone; the rejection arms draw their own "
            "answers.",
            "acceptance = accepted draft tokens per verify, from the seat's counters "
            "before and after each request; per position, the share of verifies that "
            "accepted draft token 1 / 2 / 3.",
        ]
        run = O.interleaved(opts, "rules", title, PLAIN, arms, workloads, opts.model, notes)
    spec_seen = all(any(s.figures.get("accelerated") for s in run.samples if s.arm == a)
                    for a in SPECULATIVE)
    if not spec_seen:
        return msgspec.structs.replace(
            run, not_measurable="a speculating arm never reported an accelerated answer "
            "(X-Sanctum-Speculation)")
    return run


# -- the report's section (sanctum.bench.report calls these) ---------------------------

REPORT_TEMPERATURES = tuple(f"{t:g}" for t in TEMPERATURES)


def _spec_arms(run: Run) -> list[str]:
    return [a.name for a in run.arms if a.name != run.baseline]


def headline(run: Run) -> list[tuple[str, Summary, float | None]]:
    """Per temperature: each speculating arm's decode rate over plain; then, at the pinned
    depth, rejection over keyed in decode rate and in accepted drafts per verify."""

    out: list[tuple[str, Summary, float | None]] = []
    for arm in _spec_arms(run):
        out += per_temperature(run, "decode_tps", arm, run.baseline,
                                f"decode tokens/s, {arm} over plain, t={{t}}",
                                temperatures=REPORT_TEMPERATURES)
    if {KEYED, REJECTION} <= {a.name for a in run.arms}:
        out += per_temperature(run, "decode_tps", REJECTION, KEYED,
                                f"decode tokens/s, {REJECTION} over {KEYED}, t={{t}}",
                                temperatures=REPORT_TEMPERATURES)
        out += per_temperature(run, "accept_len", REJECTION, KEYED,
                                f"accepted drafts per verify, {REJECTION} over {KEYED}, "
                                "t={t}", temperatures=REPORT_TEMPERATURES)
    return out


def _pooled(run: Run, fig: str, arm: str, workloads: list[str]) -> list[float]:
    return [x for w in workloads for x in figure_values(run.samples, fig, arm, w)]


def _median(values: list[float]) -> str:
    return f"{summarize(values).median:.3g}" if values else "-"


def positions(run: Run, arm: str, workloads: list[str]) -> str:
    """Median share of verifies that accepted draft position 1 / 2 / ..."""
    out = []
    for i in range(1, 17):
        v = _pooled(run, f"accept_p{i}", arm, workloads)
        if not v:
            break
        out.append(f"{summarize(v).median:.2f}")
    return " / ".join(out) or "-"


def table(run: Run) -> list[str]:
    """Per temperature (workloads pooled), then per workload, every arm: decode rate, its
    ratio over plain, acceptance and acceptance per position; then whether keyed and
    plain answers were the same bytes."""

    base = run.baseline
    arms = [base, *_spec_arms(run)]
    groups = [(f"all, t={t}", [w for w in run.workloads if w.endswith(f"t={t}")])
              for t in REPORT_TEMPERATURES]
    groups += [(w, [w]) for w in run.workloads]
    lines = ["Decode tokens/s (median), speed ratio over plain (median [IQR] of per-pair "
             "ratios), accepted draft tokens per verify (median) and, per draft position, "
             "the share of verifies that accepted it (median):", "",
             "| workloads | arm | decode tok/s | over plain | accepted per verify "
             "| per position |", "|---|---|---|---|---|---|"]
    for label, names in groups:
        if not names:
            continue
        for arm in arms:
            tps = _median(_pooled(run, "decode_tps", arm, names))
            if arm == base:
                lines.append(f"| {label} | {arm} | {tps} | - | - | - |")
                continue
            r = [x for w in names for x in pair_ratios(run.samples, "decode_tps", arm, base, w)]
            lines.append(f"| {label} | {arm} | {tps} | {fmt_ratio(summarize(r)) if r else '-'} "
                         f"| {_median(_pooled(run, 'accept_len', arm, names))} "
                         f"| {positions(run, arm, names)} |")
    same, pairs = same_answers(list(run.samples), KEYED, base)
    if pairs:
        lines += ["", f"Answers of {KEYED} and plain to the same prompt with the same seed "
                  f"were byte-equal in {same} of {pairs} pairs."]
    if run.samples:
        span = max(s.ended for s in run.samples) - min(s.started for s in run.samples)
        lines += ["", f"The {len(run.samples)} slots (warm-up included) ran for "
                  f"{span / 60:.1f} min."]
    return lines


def plot(run: Run, path: Path, plt: Any) -> bool:
    """Per-pair decode-rate ratios of each speculating arm over plain, per temperature."""
    rows = [(f"{arm}, t={t}", [x for w in run.workloads if w.endswith(f"t={t}")
                               for x in pair_ratios(run.samples, "decode_tps", arm,
                                                    run.baseline, w)])
            for t in REPORT_TEMPERATURES for arm in _spec_arms(run)]
    rows = [(label, r) for label, r in rows if r]
    if not rows:
        return False
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(rows) + 1.4))
    ax.boxplot([r for _, r in rows], orientation="horizontal",
               tick_labels=[label for label, _ in rows], showfliers=True)
    ax.axvline(1.0, color="grey", lw=1, ls="--")
    ax.set_title("decode tokens/s over plain, per pair", fontsize=9)
    ax.set_xlabel("speed ratio (>1: faster)", fontsize=8)
    ax.tick_params(labelsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
