"""docs/BENCHMARKS.md and its plots, rendered from the stored results alone.

Text claims ratios (per-pair, interleaved); absolute figures appear with their
spread (median and interquartile range).  A run that fails the interleaving check
is shown as refused, never as numbers.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from sanctum.bench import flips, neighbours
from sanctum.bench.batching import headline as batching_headline
from sanctum.bench.batching import plot as batching_plot
from sanctum.bench.batching import table as batching_table
from sanctum.bench.grammar import headline as grammar_headline
from sanctum.bench.grammar import table as grammar_table
from sanctum.bench.hop import section as hop_table
from sanctum.bench.results import Run, load_run
from sanctum.bench.rules import headline as rules_headline
from sanctum.bench.rules import plot as rules_plot
from sanctum.bench.rules import table as rules_table
from sanctum.bench.stats import (
    FIGURES,
    NotInterleaved,
    Summary,
    check_interleaved,
    figure_values,
    load_range,
    measured,
    pair_differences,
    pair_ratios,
    summarize,
)
from sanctum.bench.text import GOALS, fmt, fmt_ratio, fmt_summary, per_temperature

ORDER = ["stack", "mlx-server", "proxy", "spec", "cache", "rollback", "rules", "flips",
         "batching", "hop", "neighbours", "grammar", "wake"]
SECTION = {
    "stack": "1. Our stack against the same model in-process",
    "mlx-server": "2. Our stack against mlx_lm.server",
    "proxy": "3. Proxy overhead with a null seat",
    "spec": "4. Speculative against plain decoding",
    "cache": "5. Prompt cache on against off",
    "rollback": "6. Rolling back a hybrid model's recurrent layers",
    "rules": "7. Sampling rules: keyed, rejection and plain",
    "flips": "8. Float flips: speculative against plain answers",
    "batching": "9. Concurrent clients: our seat against mlx_lm.server batching",
    "hop": "10. The proxy hop: direct, nginx and proxyd",
    "neighbours": "11. Neighbours: a seeded answer alone against batched with 7 others",
    "grammar": "12. Structured output: decoding under a JSON schema",
    "wake": "13. On-demand seats: a cold wake against the model loaded",
}
# Which figures each comparison reports, and its goals (speed ratio, arm over baseline).
SHOWN = {
    "stack": ["decode_tps", "ttft_s", "e2e_s"],
    "mlx-server": ["decode_tps", "ttft_s", "e2e_s"],
    "spec": ["decode_tps", "e2e_s", "accept_len"],
    "cache": ["ttft_s", "e2e_s"],
    "wake": ["ttft_s", "e2e_s"],
    "rollback": ["round_s", "rollback_s"],
    "proxy": ["latency_p50_s", "latency_p99_s", "per_token_p50_s", "per_token_p99_s", "rps"],
}
REGENERATE = "make bench"


def _other(run: Run) -> str:
    return next(a.name for a in run.arms if a.name != run.baseline)


def _spec_headline(run: Run, arm: str, base: str) -> list[tuple[str, Summary, float | None]]:
    """A speculation run's rows beyond the two overall ones: by temperature, the pinned
    depths (one: the adaptive seat over it; a sweep: each over plain and against its
    prediction), mlx-lm's loop, and the workload groups with their goals."""
    out: list[tuple[str, Summary, float | None]] = []
    names = {a.name for a in run.arms}
    out += per_temperature(run, "decode_tps", arm, base,
                            "decode tokens/s over plain, t={t}", "spec")
    pinned = pinned_arms(run)
    if pinned == [PINNED_ARM]:
        out += per_temperature(run, "decode_tps", arm, PINNED_ARM,
                                f"decode tokens/s, adaptive over {PINNED_ARM}, t={{t}}")
    elif pinned:  # a sweep: each depth over plain, and against its prediction
        for d in pinned:
            out += per_temperature(run, "decode_tps", d, base,
                                    f"decode tokens/s, {d} over plain, t={{t}}")
        for d in pinned:
            r = measured_over_predicted(run, d)
            if r:
                out.append((f"decode tokens/s of {d}, measured over the cost model's "
                            "prediction, every workload", summarize(r), SPEC_PREDICTION))
    if MLX_SPEC in names:
        out += per_temperature(run, "decode_tps", arm, MLX_SPEC,
                                "decode tokens/s, ours over mlx-lm speculative, t={t}")
    for group, members, goal in SPEC_GROUPS:
        for t in ("0", "0.7"):
            r = [x for w in run.workloads if w.split(" t=")[0] in members
                 and w.endswith(f" t={t}")
                 for x in pair_ratios(run.samples, "decode_tps", arm, base, w)]
            if r:
                out.append((f"decode tokens/s over plain, {group}, t={t}", summarize(r),
                            goal.get(t)))
    return out


def headline(run: Run) -> list[tuple[str, Summary, float | None]]:
    """(what, ratio summary, goal) for the summary table."""
    arm, base = _other(run), run.baseline
    out: list[tuple[str, Summary, float | None]] = []
    if run.comparison == "proxy":
        r = pair_ratios(run.samples, "rps", arm, base)
        if r:
            out.append(("requests/s, proxy over direct", summarize(r), None))
        return out
    if run.comparison == "mlx-server":
        return per_temperature(run, "e2e_s", arm, base, "end-to-end speed, t={t}, all workloads",
                                "mlx-server")
    if run.comparison == "rules":

        return rules_headline(run)
    if run.comparison == "batching":

        return batching_headline(run)
    if run.comparison == "grammar":

        return grammar_headline(run)
    if run.comparison == "rollback":
        r = pair_ratios(run.samples, "round_s", arm, base)
        if r:
            out.append(("verify-round speed, recorded and rolled back over unrecorded",
                        summarize(r), None))
        return out
    for fig in ("e2e_s", "decode_tps"):
        r = pair_ratios(run.samples, fig, arm, base)
        if r:
            what = "end-to-end speed" if fig == "e2e_s" else "decode tokens/s"
            out.append((f"{what}, all workloads", summarize(r),
                        GOALS.get(run.comparison) if fig == "e2e_s" else None))
    if run.comparison == "spec":
        out += _spec_headline(run, arm, base)
    return out


# Workload groups of the speculation headline, with the goals of speculation on any pair
# (the weaker pair's code goals apply to the code group; a copy-heavy goal at t=0 only).
SPEC_GROUPS: tuple[tuple[str, tuple[str, ...], dict[str, float]], ...] = (
    ("code", ("code-short", "doc2body"), {}),
    ("copy-heavy", ("rename", "repeat", "template"), {"0": 2.0}),
    ("prose", ("prose",), {}),
)


def added_headline(run: Run) -> list[tuple[str, str]]:
    """Proxy comparison: added latency per request and per streamed token, p50."""
    arm, base = _other(run), run.baseline
    out = []
    for w, fig, what in (("latency", "latency_p50_s", "added latency per request, p50"),
                         ("stream", "per_token_p50_s", "added latency per streamed token, p50")):
        d = pair_differences(run.samples, fig, arm, base, w)
        if d:
            out.append((what, fmt_summary(summarize(d), "s")))
    return out


def _tokens_note(run: Run) -> list[str]:
    """Arms that generated different numbers of tokens are not comparable end to end."""
    arm, base = _other(run), run.baseline
    notes = []
    for w in run.workloads:
        a = figure_values(run.samples, "completion_tokens", arm, w)
        b = figure_values(run.samples, "completion_tokens", base, w)
        if a and b and summarize(a).median != summarize(b).median:
            notes.append(f"{w}: the arms generated different numbers of tokens "
                         f"(median {summarize(a).median:g} against {summarize(b).median:g}); "
                         "compare its decode rate, not its end-to-end time")
    return notes


def _table(run: Run, warnings: list[str]) -> list[str]:
    arm, base = _other(run), run.baseline
    lines = [f"| workload | figure | {arm} | {base} | speed ratio {arm}/{base} |",
             "|---|---|---|---|---|"]
    for w in run.workloads:
        for fig in SHOWN.get(run.comparison, []):
            unit = FIGURES[fig][0]
            a = figure_values(run.samples, fig, arm, w)
            b = figure_values(run.samples, fig, base, w)
            if a and not b:  # a figure only one arm has (the rollback itself)
                lines.append(f"| {w} | {fig} | {fmt_summary(summarize(a), unit)} | - | - |")
                continue
            if not a or not b:
                continue
            sa, sb = summarize(a), summarize(b)
            r = pair_ratios(run.samples, fig, arm, base, w)
            ratio = fmt_ratio(summarize(r)) if r else "-"
            for name, s in ((arm, sa), (base, sb)):
                if s.wide:
                    warnings.append(f"{w}, {fig}, {name}: wide spread (IQR {s.rel_spread:.0%} "
                                    "of the median)")
            if r and summarize(r).wide:
                warnings.append(f"{w}, {fig}: per-pair ratios spread widely "
                                f"(IQR {summarize(r).rel_spread:.0%})")
            lines.append(f"| {w} | {fig} | {fmt_summary(sa, unit)} | {fmt_summary(sb, unit)} "
                         f"| {ratio} |")
    return lines


def _added(run: Run) -> list[str]:
    """Proxy comparison: what the proxy adds, per pair."""
    arm, base = _other(run), run.baseline
    lines = ["| figure | added by the proxy (median [IQR] of per-pair differences) |",
             "|---|---|"]
    for w, figs in (("latency", ("latency_p50_s", "latency_p99_s")),
                    ("stream", ("per_token_p50_s", "per_token_p99_s"))):
        for fig in figs:
            d = pair_differences(run.samples, fig, arm, base, w)
            if d:
                s = summarize(d)
                what = "per request" if w == "latency" else "per streamed token"
                lines.append(f"| {what}, {fig.split('_')[-2]} | "
                             f"{fmt_summary(s, 's')} |")
    return lines


MLX_SPEC = "mlx-lm speculative"
PINNED_ARM = "speculative d3"  # an adaptive run's pinned-depth arm (comparisons.PINNED)
SPEC_PREDICTION = 0.95  # goal: a pinned depth's measured speed over its predicted


def pinned_arms(run: Run) -> list[str]:
    """A speculation run's pinned-depth arms ('speculative dN'), shallowest first."""
    names = [a.name for a in run.arms if a.name.startswith("speculative d")
             and a.name.removeprefix("speculative d").isdigit()]
    return sorted(names, key=lambda n: int(n.removeprefix("speculative d")))


def measured_over_predicted(run: Run, arm: str, workload: str | None = None) -> list[float]:
    """Per measured request of `arm`: its decode tokens/s over the tokens/s the seat's
    cost model predicted for it (requests with no prediction are left out).  Pure."""
    return [s.figures["decode_tps"] / s.figures["predicted_tps"] for s in measured(run.samples)
            if s.arm == arm and (workload is None or s.workload == workload)
            and s.figures.get("predicted_tps") and "decode_tps" in s.figures]


def spec_against_mlx(run: Run) -> list[str]:
    """Speculation: our speculative arm against mlx-lm's own speculative loop, per
    workload, with both acceptance lengths and per-position acceptance."""
    arms = {a.name for a in run.arms}
    ours = "speculative"
    if run.comparison != "spec" or not {ours, MLX_SPEC} <= arms:
        return []

    def med(fig: str, arm: str, w: str) -> str:
        v = figure_values(run.samples, fig, arm, w)
        return f"{summarize(v).median:.2f}" if v else "-"

    def positions(arm: str, w: str) -> str:
        out = []
        for i in range(1, 17):
            v = figure_values(run.samples, f"accept_p{i}", arm, w)
            if not v:
                break
            out.append(f"{summarize(v).median:.2f}")
        return " / ".join(out) or "-"

    lines = ["Ours against mlx-lm's speculative loop (same pair, same depth), and "
             "acceptance: accepted draft tokens per verify (median); per position, the "
             "share of verifies that accepted draft token 1 / 2 / ...", "",
             "| workload | decode tok/s ours | decode tok/s mlx-lm | speed ratio ours/mlx-lm "
             "| e2e ratio ours/mlx-lm | acceptance length ours | acceptance length mlx-lm "
             "| per position ours | per position mlx-lm |",
             "|---|---|---|---|---|---|---|---|---|"]
    for w in run.workloads:
        r = pair_ratios(run.samples, "decode_tps", ours, MLX_SPEC, w)
        e = pair_ratios(run.samples, "e2e_s", ours, MLX_SPEC, w)
        lines.append(f"| {w} | {med('decode_tps', ours, w)} | {med('decode_tps', MLX_SPEC, w)} "
                     f"| {fmt_ratio(summarize(r)) if r else '-'} "
                     f"| {fmt_ratio(summarize(e)) if e else '-'} "
                     f"| {med('accept_len', ours, w)} | {med('accept_len', MLX_SPEC, w)} "
                     f"| {positions(ours, w)} | {positions(MLX_SPEC, w)} |")
    return [*lines, ""]


def spec_prediction(run: Run) -> list[str]:
    """Speculation: each pinned-depth arm's decode tokens/s beside what the seat's cost
    model predicts at the acceptance it had, and the adaptive arm's share of rounds
    drafted by prompt lookup."""
    if run.comparison != "spec":
        return []
    pinned = [a.name for a in run.arms
              if any(s.arm == a.name and "predicted_tps" in s.figures for s in run.samples)]
    if not pinned:
        return []

    def med(fig: str, arm: str, w: str) -> float | None:
        v = figure_values(run.samples, fig, arm, w)
        return summarize(v).median if v else None

    lines = ["Measured against the cost model: decode tok/s of each pinned depth beside "
             "the seat's prediction from its measured drafting and verify time per round "
             "at the acceptance the request had (host work left out: the ratio is what it "
             "costs), the host's share of a round, and the adaptive arm's share of verify "
             "rounds drafted by prompt lookup.", "",
             "| workload | arm | decode tok/s | predicted tok/s | measured / predicted "
             "| host share of a round | lookup share, adaptive |",
             "|---|---|---|---|---|---|---|"]

    def pct(x: float | None) -> str:
        return f"{x:.0%}" if x is not None else "-"

    for w in run.workloads:
        share = med("lookup_share", "speculative", w)
        for arm in pinned:
            got, want = med("decode_tps", arm, w), med("predicted_tps", arm, w)
            if got is None or not want:
                lines.append(f"| {w} | {arm} | - | - | - | - | {pct(share)} |")
                continue
            lines.append(f"| {w} | {arm} | {got:.1f} | {want:.1f} | {got / want:.2f}x "
                         f"| {pct(med('host_share', arm, w))} | {pct(share)} |")
    return [*lines, ""]


def section(run: Run, plot: str | None, name: str | None = None) -> list[str]:
    title = SECTION.get(run.comparison, run.comparison)
    if name and name != run.comparison:
        title += f" ({name.removeprefix(run.comparison + '-')})"
    lines = [f"## {title}", ""]
    if run.not_measurable:
        return [*lines, f"**Not yet measurable:** {run.not_measurable}.", ""]
    try:
        check_interleaved(run.samples)
    except NotInterleaved as exc:
        return [*lines, f"**Refused:** the arms were not interleaved ({exc}).", ""]
    m = run.machine
    python = f", Python {m['python']}" if "python" in m else ""
    device = f", on {m['device']}" if "device" in m else ""  # runs of one page may differ
    lines += [f"{run.title}. Run `{run.run_id}`, {m.get('date', '?')}{device}, model "
              f"`{m.get('model', '?')}`{python}; {run.rounds} rounds of which {run.warmup} "
              f"warm-up, seed {run.seed}.", ""]
    for a in run.arms:
        lines.append(f"- **{a.name}**: {a.description}")
    lines.append("")
    lines += [f"- {n}" for n in run.notes]
    for name, desc in run.workloads.items():
        lines.append(f"- workload `{name}`: {desc.replace(' (0 prompt tokens)', '')}")
    lo, hi = load_range(run.samples)
    lines += [f"- 1-minute load average during the measured slots: {lo:.2f}–{hi:.2f} "
              f"({m.get('cores', '?')} cores)", ""]
    warnings: list[str] = []
    cores = float(m.get("cores", "0") or 0)
    if cores and hi > cores:
        warnings.append(f"load average reached {hi:.2f} on {cores:g} cores: others were "
                        "busy; only the per-pair ratios are meaningful")
    warnings += _tokens_note(run)
    errors = [s for s in run.samples if s.error]
    if errors:
        warnings.append(f"{len(errors)} slots failed and were left out "
                        f"(first: {errors[0].error})")
    heads = headline(run)
    if heads:
        lines += ["| headline | speed ratio (median [IQR] of per-pair ratios) | goal |",
                  "|---|---|---|"]
        for what, s, goal in heads:
            lines.append(f"| {what} | {fmt_ratio(s)} | {f'≥ {goal:g}x' if goal else '-'} |")
        lines.append("")
    if run.comparison == "proxy":
        lines += [*_added(run), ""]
    if run.comparison == "rules":

        lines += [*rules_table(run), ""]
    elif run.comparison == "batching":

        lines += [*batching_table(run), ""]
    elif run.comparison == "hop":

        lines += [*hop_table(run), ""]
    elif run.comparison == "grammar":

        lines += [*grammar_table(run), ""]
    else:
        lines += [*_table(run, warnings), ""]
    lines += spec_against_mlx(run)
    lines += spec_prediction(run)
    if plot:
        lines += [f"![{run.comparison}]({plot})", ""]
    if warnings:
        lines += ["Warnings:", ""] + [f"- {w}" for w in warnings] + [""]
    return lines


def plot_run(run: Run, path: Path) -> bool:
    """Per-pair speed ratios per workload and figure, as box plots."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    if run.comparison == "rules":

        return rules_plot(run, path, plt)
    if run.comparison == "batching":

        return batching_plot(run, path, plt)
    arm, base = _other(run), run.baseline
    figs = [f for f in SHOWN.get(run.comparison, []) if f in FIGURES]
    figs = [f for f in figs if any(pair_ratios(run.samples, f, arm, base, w)
                                   for w in run.workloads)]
    if not figs:
        return False
    fig, axes = plt.subplots(1, len(figs), figsize=(4.2 * len(figs), 3.8), squeeze=False)
    for ax, f in zip(axes[0], figs, strict=True):
        names = [w for w in run.workloads if pair_ratios(run.samples, f, arm, base, w)]
        data = [pair_ratios(run.samples, f, arm, base, w) for w in names]
        ax.boxplot(data, orientation="horizontal", tick_labels=names, showfliers=True)
        ax.axvline(1.0, color="grey", lw=1, ls="--")
        ax.set_title(f"{f}: {arm} / {base}", fontsize=9)
        ax.set_xlabel("speed ratio (>1: faster)", fontsize=8)
        ax.tick_params(labelsize=7)
    fig.suptitle(f"{SECTION.get(run.comparison, run.comparison)} — per-pair ratios",
                 fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def render(runs: dict[str, Run], plot_dir: Path | None,
           plot: Callable[[Run, Path], bool] = plot_run, rel: str = "bench",
           gpu: bool = False) -> str:
    """The page; `gpu`: the part for runs on a GPU (results/gpu/), its headings marked
    so, and only the comparisons that ran there."""
    if gpu:
        return _gpu_part(render(runs, plot_dir, plot, rel))
    lines = [
        "# Benchmarks", "",
        "Every comparison below ran its arms **interleaved** in one run (A B A B ..., the "
        "starting arm drawn from a seed, the first round a warm-up that is not reported), "
        "on the same machine and model. Ratios are per pair: the two arms' samples from "
        "the same round and workload, taken back to back, so a slow minute slows both. A "
        "speed ratio above 1 means the first arm was faster. The text claims ratios; "
        "absolute figures are shown as median [interquartile range].", "",
        f"Regenerate everything with `{REGENERATE}` (runs every comparison, then "
        "`sanctum bench report`); `sanctum bench report` alone re-renders this page from "
        "`docs/bench/results/*.json`.", "",
    ]
    names = [n for o in ORDER for n in ([o, *sorted(k for k in runs if k.startswith(o + "-"))]
                                         if o in ("spec", "batching", "wake") else [o])]
    # The first comparison in report order names the machine (each section names its model).
    any_run = next((runs[n] for n in names if n in runs and runs[n].machine), None)
    if any_run:
        m = any_run.machine
        lines += ["| machine | |", "|---|---|"]
        for k in ("date", "platform", "cpu", "cores", "device", "python", "mlx", "mlx-lm",
                  "openai", "sanctum", "blas", "model"):
            if k in m:
                lines.append(f"| {k} | {m[k]} |")
        lines.append("")
        # A shape: model (random weights of a deployment's shape) is a speed-only run
        # that names itself in its section, not a development stand-in for the demo.
        if not str(m.get("model", "")).startswith(("builtin:", "shape:")):
            lines += [f"**These numbers use a development model ({m.get('model')}), not the "
                      "packaged demo models;** rerun `make bench` once `builtin:demo` exists.",
                      ""]
    summary = ["## Headline ratios", "", "| comparison | what | speed ratio | goal |",
               "|---|---|---|---|"]
    body: list[str] = []
    for name in names:
        run = runs.get(name)
        if run is None:
            summary.append(f"| {SECTION.get(name, name)} | - | not run yet | - |")
            continue
        label = SECTION.get(run.comparison, run.comparison)
        if name != run.comparison:
            label += f" ({name.removeprefix(run.comparison + '-')})"
        if run.comparison in ("flips", "neighbours") and not run.not_measurable:
            # A correctness measure without interleaved samples: its own section.

            own = flips if run.comparison == "flips" else neighbours
            body += own.section(run, label)
            summary += [f"| {label} | {what} | {text} | - |" for what, text in own.headline(run)]
            continue
        plot_rel = None
        if plot_dir is not None and not run.not_measurable:
            try:
                check_interleaved(run.samples)
                if plot(run, plot_dir / f"{name}.png"):
                    plot_rel = f"{rel}/{name}.png"
            except NotInterleaved:
                pass
        body += section(run, plot_rel, name)
        if run.not_measurable:
            summary.append(f"| {label} | - | not yet measurable | - |")
            continue
        try:
            heads = headline(run)
        except NotInterleaved:
            summary.append(f"| {label} | - | refused: not interleaved | - |")
            continue
        for what, s, goal in heads:
            summary.append(f"| {label} | {what} | {fmt_ratio(s)} | "
                           f"{f'≥ {goal:g}x' if goal else '-'} |")
        if name == "proxy":
            for what, text in added_headline(run):
                summary.append(f"| {label} | {what} | {text} | - |")
    return "\n".join([*lines, *summary, "", *body]).rstrip() + "\n"


def load_section(data: dict[str, object]) -> list[str]:
    """The load test: requests served, errors, p99, and whether overload was answered."""
    def ms(x: object) -> str:
        return fmt(float(x), "s") if isinstance(x, int | float) else "-"

    return [
        "## Load test", "",
        f"{data['clients']} concurrent clients for {data['seconds']} s against `sanctum up` "
        f"(loopback), {data['tokens']} new tokens per request."
        + (f" 1-minute load average {float(data['load_before']):.2f} before, "  # type: ignore[arg-type]
           f"{float(data['load_after']):.2f} after "  # type: ignore[arg-type]
           f"({dict(data.get('machine') or {}).get('cores', '?')} cores)."  # type: ignore[call-overload]
           if "load_before" in data else ""), "",
        "| requests | served | served/s | errors | overload answers (429/503) | "
        "without Retry-After | hangs | p50 | p99 |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {data['requests']} | {data['served']} | {float(data['served_per_s']):.3g} "  # type: ignore[arg-type]
        f"| {data['errors'] or 0} | {data['overload_answers']} | "
        f"{data['overload_without_retry_after']} | {data['hangs']} | {ms(data['p50_s'])} | "
        f"{ms(data['p99_s'])} |", ""]


GPU = "gpu"  # results/gpu/: runs on a GPU (MLX's CUDA backend, Metal), rendered apart


def _gpu_part(page: str) -> str:
    """A rendered page as the GPU part: its own heading and machine table, the comparisons
    that ran there (no "not run yet" rows), every section heading marked "GPU"."""
    lines = page.splitlines()
    start = next((i for i, line in enumerate(lines)
                  if line.startswith("| machine") or line.startswith("## ")), len(lines))
    kept = [line for line in lines[start:] if "| not run yet |" not in line]
    return "\n".join([
        "# On a GPU", "",
        "The same comparisons, run on a GPU through MLX's GPU backend (each run names its "
        "device; the machine table is the first run's); results in "
        "`docs/bench/results/gpu/`. Ratios compare arms of the same run only.", "",
        *(f"## GPU: {line[3:]}" if line.startswith("## ") else line for line in kept)]) + "\n"


def write_report(results: Path, doc: Path) -> Path:
    import json

    runs = {p.stem: load_run(p) for p in sorted(results.glob("*.json")) if p.stem != "load"}
    plot_dir = doc.parent / "bench"
    rel = os.path.relpath(plot_dir, doc.parent)
    doc.parent.mkdir(parents=True, exist_ok=True)
    text = render(runs, plot_dir, rel=rel)
    gpu = sorted((results / GPU).glob("*.json"))
    if gpu:
        text += "\n" + render({p.stem: load_run(p) for p in gpu}, plot_dir / GPU,
                              rel=f"{rel}/{GPU}", gpu=True)
    load = results / "load.json"
    if load.exists():
        text += "\n" + "\n".join(load_section(json.loads(load.read_text())))
    doc.write_text(text)
    return doc
