"""`sanctum bench grammar`: decoding under a JSON schema against unconstrained decoding,
speculation on and off, on one seat of the demo config, interleaved.

Arms (all through `sanctum up`, the demo pair, the same seat, the same prompt):

    schema spec    response_format json_schema (BENCH_SCHEMA), speculation on
    schema plain   the same, speculation off by the request (`sanctum.speculation`)
    free spec      the same prompt without response_format, speculation on
    free plain     the same, speculation off

Headline ratios (per pair, `sanctum.bench.stats`): schema over free at each speculation
setting (what the grammar costs a seat), spec over plain under the schema (whether
speculation still pays under a grammar) and without it.  Each schema answer is checked:
`json` (it parses) and `valid` (it validates, when the `jsonschema` package is there);
every answer's checksum shows whether spec and plain answered the same (same seed).

Before the A/B, the grammar's own cost is measured in this process with the seat's
tokenizer (`mask_cost`): mask plus consume per token along a valid answer, median and
p99 microseconds, stored in the run's `extra`.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import msgspec

from sanctum.bench import arms as A
from sanctum.bench import options as O
from sanctum.bench import servers
from sanctum.bench.options import Options, ensure_worker_blas
from sanctum.bench.results import Run, Sample
from sanctum.bench.runner import Measure
from sanctum.bench.stats import Summary, figure_values, pair_ratios, quantile, summarize

SCHEMA_SPEC, SCHEMA_PLAIN = "schema spec", "schema plain"
FREE_SPEC, FREE_PLAIN = "free spec", "free plain"
ARMS = (SCHEMA_SPEC, SCHEMA_PLAIN, FREE_SPEC, FREE_PLAIN)
WORKLOADS = ("doc2body", "rename")  # the chat workloads (a schema is a chat-only field)
TOKENS = 160  # enough for a whole BENCH_SCHEMA answer: a cut one would not parse
TEMPERATURES = (0.0, 0.7)

# A function described as JSON: nested objects and arrays, enums, bounded strings, so
# that an answer ends well within TOKENS.
TYPES = ["int", "str", "float", "bool", "list", "dict", "None", "object"]
BENCH_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 32},
        "arguments": {
            "type": "array",
            "maxItems": 4,
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 16},
                               "type": {"enum": TYPES}},
                "required": ["name", "type"],
                "additionalProperties": False,
            },
        },
        "returns": {"enum": TYPES},
        "pure": {"type": "boolean"},
        "summary": {"type": "string", "maxLength": 80},
    },
    "required": ["name", "arguments", "returns", "pure", "summary"],
    "additionalProperties": False,
}


def response_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema",
            "json_schema": {"name": "function", "schema": schema, "strict": True}}


def example_answer() -> str:
    """A BENCH_SCHEMA answer as a model would write it (the cost measurement's text)."""
    return json.dumps({
        "name": "rename_parameter",
        "arguments": [{"name": "source", "type": "str"}, {"name": "old", "type": "str"},
                      {"name": "new", "type": "str"}],
        "returns": "str",
        "pure": True,
        "summary": "Rename a parameter of a function and return the new source.",
    })


def answer_figures(text: str, schema: dict[str, Any]) -> dict[str, float]:
    """`json`: the answer parses; `valid`: it validates (needs `jsonschema`).  Pure."""
    try:
        value = json.loads(text)
    except ValueError:
        return {"json": 0.0, "valid": 0.0}
    try:
        import jsonschema
    except ImportError:
        return {"json": 1.0}
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return {"json": 1.0, "valid": 0.0}
    return {"json": 1.0, "valid": 1.0}


def request_body(constrained: bool, speculation: bool) -> dict[str, Any]:
    """What an arm adds to the request body (the openai SDK's `extra_body`).  Pure."""
    body: dict[str, Any] = {}
    if constrained:
        body["response_format"] = response_format(BENCH_SCHEMA)
    if not speculation:
        body["sanctum"] = {"speculation": False}
    return body


class GrammarArm(A.SeatSpecArm):
    """A seat's streamed answers (with its acceptance counters), seeded `seed + k` for
    the k-th request of a workload, constrained or not; schema answers are checked."""

    def __init__(self, base_url: str, seat: str, max_tokens: int,
                 workloads: dict[str, Any], constrained: bool, speculation: bool,
                 seed: int = 1) -> None:
        super().__init__(base_url, seat, 0.0, max_tokens, workloads, seed=seed)
        self.constrained = constrained
        self.extra_body = request_body(constrained, speculation)

    def request_seed(self, k: int) -> int | None:
        return None if self.seed is None else self.seed + k

    def __call__(self, name: str) -> dict[str, float]:
        figures = super().__call__(name)
        figures["answer_crc"] = float(zlib.crc32(self.last_text.encode()))
        if self.constrained:
            figures |= answer_figures(self.last_text, BENCH_SCHEMA)
        return figures


def mask_cost(tokenizer: Any, width: int, text: str, schema: dict[str, Any],
              runs: int = 30) -> dict[str, float]:
    """Microseconds of mask() plus consume() per token along `text` under `schema`,
    median and p99 over `runs` passes, with the seat's grammar code and tokenizer."""
    from seatd.grammar import SeatGrammar
    from shared.protocol import Generate, SamplingParams

    seat = SeatGrammar(tokenizer, width)
    req = Generate("cost", False, SamplingParams(),
                   response_format=json.dumps(response_format(schema)))
    t0 = time.perf_counter()
    seat.for_request(req)
    compile_s = time.perf_counter() - t0
    ids = list(tokenizer.encode(text))
    per: list[float] = []
    for _ in range(runs):
        m = seat.for_request(req)
        assert m is not None
        for t in ids:
            a = time.perf_counter()
            m.mask()
            m.consume([t])
            per.append(time.perf_counter() - a)
        if not m.accepting:
            raise ValueError("the cost text is not a complete answer under the schema")
    return {"mask_consume_us_p50": 1e6 * statistics.median(per),
            "mask_consume_us_p99": 1e6 * quantile(per, 0.99),
            "tokens": float(len(ids)), "runs": float(runs), "vocab": float(seat.vocab),
            "compile_ms": 1e3 * compile_s}


def grammar(opts: Options) -> Run:
    """The comparison (see the module docstring)."""
    import dataclasses

    from shared.builtin import resolve_model
    from shared.prompt import load_tokenizer

    title = "Decoding under a JSON schema against unconstrained, speculation on and off"
    try:
        drafter = resolve_model(opts.drafter)
    except ValueError as exc:
        return O.not_measurable("grammar", title, f"no drafter model ({exc})", opts.model)
    path = O.model_path(opts.model)
    tokenizer = load_tokenizer(path)
    width = int(json.loads((path / "config.json").read_text()).get("vocab_size", 0)) or None
    cost = mask_cost(tokenizer, width or len(tokenizer), example_answer(), BENCH_SCHEMA)
    cap = O.seat_cap(2048, opts.tokens)
    source, base = O.workloads_for(tokenizer, cap)
    base = [w for w in base if w.name in (opts.workloads or WORKLOADS)]
    workloads = [dataclasses.replace(w, name=f"{w.name} t={t:g}", temperature=t)
                 for t in TEMPERATURES for w in base]
    by_name = {w.name: w for w in workloads}
    extra = f'drafter = {{ kind = "model", path = "{drafter}" }}\nspeculation = true\n'
    seats = [("grammar", str(path), cap + 64, extra)]
    port = servers.free_port()
    config = servers.sanctum_config(port, seats)
    with servers.sanctum_up(config, ("grammar",), port) as url:
        def arm(constrained: bool, speculation: bool) -> GrammarArm:
            return GrammarArm(url, "grammar", opts.tokens, by_name, constrained, speculation)

        arms: dict[str, tuple[str, Measure]] = {
            SCHEMA_SPEC: ("response_format json_schema, speculation on", arm(True, True)),
            SCHEMA_PLAIN: ("response_format json_schema, speculation off by the request",
                           arm(True, False)),
            FREE_SPEC: ("the same prompt without response_format, speculation on",
                        arm(False, True)),
            FREE_PLAIN: ("the same prompt without response_format, speculation off",
                         arm(False, False)),
        }
        notes = [
            f"Workloads from {source}, chat only, each at temperature "
            + " and ".join(f"{t:g}" for t in TEMPERATURES)
            + f"; at most {opts.tokens} new tokens; the k-th request of a workload is "
            "seeded 1 + k in every arm.",
            "One seat of the demo config (demo target, demo drafter); speculation is "
            "turned off per request (`sanctum.speculation = false`). A schema answer "
            "ends when its JSON is complete, a free one usually at the token limit: "
            "decode tokens/s compares per-token rates, not answer lengths.",
            f"The grammar's own cost in this process, seat tokenizer ({cost['vocab']:.0f} "
            f"entries), a {cost['tokens']:.0f}-token valid answer, {cost['runs']:.0f} "
            f"passes: mask + consume {cost['mask_consume_us_p50']:.0f} us per token "
            f"(median), {cost['mask_consume_us_p99']:.0f} us (p99); compiling the "
            f"schema {cost['compile_ms']:.1f} ms once per seat.",
        ]
        run = O.interleaved(opts, "grammar", title, FREE_PLAIN, arms, workloads, opts.model, notes)
    run = msgspec.structs.replace(run, extra={"grammar_cost": cost})
    why = not_constrained(run.samples)
    return msgspec.structs.replace(run, not_measurable=why) if why else run


def not_constrained(samples: list[Sample]) -> str | None:
    """Why the schema arms measured nothing (the seat refused the field, or answered
    free text: a seat without the grammar wired in), or None.  Pure."""
    constrained = [s for s in samples if s.arm in (SCHEMA_SPEC, SCHEMA_PLAIN) and not s.warmup]
    if any(s.figures.get("json") for s in constrained):
        return None
    errors = sorted({s.error for s in constrained if s.error})
    why = "; ".join(errors[:2]) or "its answers were not JSON"
    return f"the seat did not answer under the schema ({why})"


# -- what the run says (printed by the command; report.py may call these) -------------


def headline(run: Run) -> list[tuple[str, Summary, float | None]]:
    """Per temperature: schema over free at each speculation setting, and spec over
    plain with and without the schema (decode tokens/s, per pair); no goals."""
    out: list[tuple[str, Summary, float | None]] = []
    pairs = ((SCHEMA_SPEC, FREE_SPEC, "schema over free, speculation on"),
             (SCHEMA_PLAIN, FREE_PLAIN, "schema over free, speculation off"),
             (SCHEMA_SPEC, SCHEMA_PLAIN, "spec over plain, under the schema"),
             (FREE_SPEC, FREE_PLAIN, "spec over plain, free text"))
    temps = sorted({w.rsplit("t=", 1)[-1] for w in run.workloads})
    for arm, base, what in pairs:
        for t in temps:
            r = [x for w in run.workloads if w.endswith(f"t={t}")
                 for x in pair_ratios(run.samples, "decode_tps", arm, base, w)]
            if r:
                out.append((f"decode tokens/s, {what}, t={t}", summarize(r), None))
    return out


def _share(values: list[float]) -> str:
    return f"{int(sum(values))} of {len(values)}" if values else "-"


def _median(values: list[float], fmt: str) -> str:
    return format(summarize(values).median, fmt) if values else "-"


def table(run: Run) -> list[str]:
    """Markdown: per arm, median decode tokens/s, acceptance and the schema checks."""
    lines = ["| arm | decode tok/s (median) | accepted drafts per verify | answers JSON "
             "| answers valid |", "|---|---|---|---|---|"]
    for a in run.arms:
        def values(fig: str, arm: str = a.name) -> list[float]:
            return figure_values(run.samples, fig, arm)

        lines.append(f"| {a.name} | {_median(values('decode_tps'), '.3g')} | "
                     f"{_median(values('accept_len'), '.2f')} | {_share(values('json'))} | "
                     f"{_share(values('valid'))} |")
    return lines


def summary_lines(run: Run) -> list[str]:
    if run.not_measurable:
        return [f"not measurable: {run.not_measurable}"]
    from sanctum.bench.rules import same_answers

    lines = [f"## {run.title}", "", *table(run), ""]
    for what, s, _ in headline(run):
        lines.append(f"- {what}: {s.median:.3f}x [{s.lo:.3f}-{s.hi:.3f}], {s.n} pairs")
    for arm, other in ((SCHEMA_SPEC, SCHEMA_PLAIN), (FREE_SPEC, FREE_PLAIN)):
        same, pairs = same_answers(run.samples, arm, other)
        accelerated = figure_values(run.samples, "accelerated", arm)
        lines.append(f"- {arm}: {_share(accelerated)} answers accelerated; the same answer "
                     f"as {other} (same seed) in {same} of {pairs} pairs")
    return [*lines, "", *(f"- {n}" for n in run.notes)]


def cmd_grammar(args: Any) -> int:
    """`sanctum bench grammar`: run, store `grammar.json`, print the summary."""
    from sanctum.bench.results import save_run

    ensure_worker_blas()
    opts = Options(model=args.model, drafter=args.drafter, rounds=args.rounds,
                   warmup=args.warmup, tokens=args.tokens, seed=args.seed)
    opts.workloads = tuple(w for w in args.workloads.split(",") if w)
    run = grammar(opts)
    out = Path(args.out) / "grammar.json"
    save_run(run, out)
    print("\n".join(summary_lines(run)))
    print(f"stored {out}", file=sys.stderr)
    return 1 if run.not_measurable else 0


def add_parser(bsub: Any, results: str) -> None:
    """`sanctum bench grammar` on `sanctum bench`'s subcommands."""

    d = Options()
    p = bsub.add_parser("grammar", help="decoding under a JSON schema against "
                        "unconstrained, speculation on and off (interleaved)")
    p.add_argument("--model", default=d.model)
    p.add_argument("--drafter", default=d.drafter)
    p.add_argument("--rounds", type=int, default=d.rounds, help="rounds, warm-up included")
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--tokens", type=int, default=TOKENS, help="new tokens at most per request")
    p.add_argument("--seed", type=int, default=d.seed, help="decides which arm starts")
    p.add_argument("--workloads", default="", help=f"default: {','.join(WORKLOADS)}")
    p.add_argument("--out", default=results, help="results folder")
    p.set_defaults(fn=cmd_grammar)
