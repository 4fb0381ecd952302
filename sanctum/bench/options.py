"""What every comparison shares: its options, the machine it ran on, its model's path,
its interleaved run, and the bench process's own BLAS.

    Options                  a run's settings (`sanctum bench run`'s flags)
    model_path(spec)         a builtin, a directory, or shape:NAME (random weights)
    float32_copy(path, dest) the weights a seat computes with, for mlx_lm.server
    machine(model)           the machine table of a result
    interleaved(opts, ...)   one interleaved schedule of arms over workloads, as a Run
    not_measurable(...)      a Run that says why it has no samples
    ensure_worker_blas()     re-exec with the seat workers' BLAS preloaded

Its own module so that the registry of comparisons (`sanctum.bench.comparisons`) and the
comparisons it lists (rules, grammar, flips, ...) import it, and not each other.
"""

from __future__ import annotations

import datetime
import os
import platform
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sanctum.bench.results import ArmInfo, Run, Sample
from sanctum.bench.runner import Measure, new_run_id, run_schedule
from sanctum.bench.schedule import make_schedule
from sanctum.bench.workloads import Workload, build_workloads, heldout_files

SPEC_WORKLOADS = ("code-short", "doc2body", "rename", "repeat", "template", "prose")
REEXEC_FLAG = "SANCTUM_BENCH_REEXEC"


@dataclass
class Options:
    model: str = "builtin:demo"
    drafter: str = "builtin:demo-drafter"
    rounds: int = 6
    warmup: int = 1
    tokens: int = 64
    seed: int = 0
    temperature: float = 0.0
    # batching above temperature 0: our seats' requests unseeded, as chat clients send them
    # (a seeded request samples by the keyed rule; an unseeded one by a key chain)
    unseeded: bool = False
    # speculation: the seat's fixed draft depth (None: the seat's adaptive depth), also
    # mlx-lm's num_draft_tokens
    draft_depth: int | None = 4
    # speculation, adaptive runs: the pinned depths measured beside the adaptive seat, each
    # on a seat of its own with its cost model's prediction (default: PINNED alone)
    pinned_depths: tuple[int, ...] = ()
    # only these workloads (names before the temperature suffix); empty: each comparison's own
    workloads: tuple[str, ...] = ()
    # batching: only these arms besides our two seats (each one a server on the device);
    # empty: every arm
    arms: tuple[str, ...] = ()
    # proxy overhead
    requests: int = 200
    clients: int = 8
    seconds: float = 3.0
    # the proxy hop: concurrent clients for requests/s (its goal is set at 16)
    hop_clients: int = 16
    # float flips: new tokens per answer (long answers: a flip can happen anywhere)
    flip_tokens: int = 256
    # concurrent clients (batching): its own defaults, so that a default run stays near
    # ten minutes on a 2-core machine; --clients, --rounds and --tokens set them
    batch_clients: tuple[int, ...] = (1, 2, 4, 8, 16)
    batch_rounds: int = 3
    batch_tokens: int = 96
    verbose: bool = True




def model_path(spec: str) -> Path:
    from sanctum.bench.shapes import PREFIX, shape_model
    from shared.builtin import resolve_model

    if spec.startswith(PREFIX):  # a random-weight model of a real shape, for speed only
        try:
            return shape_model(spec.removeprefix(PREFIX))
        except ValueError as exc:
            raise SystemExit(f"sanctum bench: {exc}") from None
    path = resolve_model(spec)
    if not (path / "config.json").exists():
        raise SystemExit(f"sanctum bench: no model at {spec!r} (give --model DIR)")
    return path


def machine(model: str) -> dict[str, str]:
    import importlib.metadata as md

    from seatd.blas import loaded_blas

    def version(pkg: str) -> str:
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return "-"

    from seatd.backend import backend, device_name

    cores = os.cpu_count() or 0
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "platform": f"{platform.system()} {platform.machine()}",
        "cpu": _cpu_name(),
        "cores": str(cores),
        "device": f"{backend()}: {device_name()}",
        # the version and its build: the same version built with and without profile-
        # guided optimisation runs pure Python 1.3-1.5x apart (deploy/interp_speed.py)
        "python": f"{platform.python_version()} (built {platform.python_build()[1]}, "
                  f"{platform.python_compiler()})",
        "mlx": version("mlx"),
        "mlx-lm": version("mlx-lm"),
        "openai": version("openai"),
        "sanctum": version("sanctum"),
        "blas": loaded_blas(),
        "model": model_label(model),
    }


def model_label(spec: str) -> str:
    """How a model is named in results: a builtin by name, a directory by its last part
    (results are published; a machine's absolute paths are not)."""
    if spec.startswith("builtin:") or "/" not in spec:
        return spec
    return f"{Path(spec).expanduser().name} (a local model directory)"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "-"


def progress(opts: Options) -> Callable[[Sample], None] | None:
    if not opts.verbose:
        return None

    def show(s: Sample) -> None:
        figs = " ".join(f"{k}={v:.4g}" for k, v in s.figures.items()
                        if k in ("decode_tps", "ttft_s", "e2e_s", "latency_p50_s",
                                 "per_token_p50_s", "rps", "accept_len", "predicted_tps",
                                 "host_share", "lookup_share"))
        tag = "warm-up " if s.warmup else ""
        print(f"  [{s.seq:>3}] r{s.round} {tag}{s.workload:<18} {s.arm:<16} "
              f"load {s.load_before:.2f}  {s.error or figs}", file=sys.stderr, flush=True)

    return show


def workloads_for(tokenizer: object, cap: int) -> tuple[str, list[Workload]]:
    source, files = heldout_files()
    encode = tokenizer.encode  # type: ignore[attr-defined]
    return source, build_workloads(files, lambda s: len(encode(s)), cap)


def interleaved(opts: Options, comparison: str, title: str, baseline: str,
                arms: dict[str, tuple[str, Measure]], workloads: list[Workload], model: str,
                notes: list[str]) -> Run:
    """Run the arms' interleaved schedule over the workloads (`sanctum.bench.schedule`)
    and gather the samples into a `Run`."""
    run_id = new_run_id()
    slots = make_schedule(list(arms), [w.name for w in workloads], opts.rounds, opts.warmup,
                          opts.seed)
    samples = run_schedule(slots, {n: m for n, (_, m) in arms.items()}, run_id=run_id,
                           progress=progress(opts))
    return Run(run_id, comparison, title, baseline,
               [ArmInfo(n, d) for n, (d, _) in arms.items()],
               {w.name: f"{w.description} ({w.prompt_tokens} prompt tokens)" for w in workloads},
               opts.rounds, opts.warmup, opts.seed, machine(model), samples, notes)


def seat_cap(context_length: int, tokens: int) -> int:
    return max(256, min(4096, context_length - tokens - 64))




def float32_copy(path: Path, dest: Path) -> Path:
    """The weights our seat computes with, saved for mlx_lm.server (same model, same dtype).
    Off the CPU the seat computes the weights as stored (`seatd.model_load.choose_dtype`),
    quantized ones included: mlx_lm.server then takes the folder itself (a copy saved
    without its quantization config would not load)."""
    import json

    from mlx_lm.utils import save

    from seatd.model_load import load_for_compute, on_cpu

    if not on_cpu():
        return path
    got = load_for_compute(path)
    if not got.was_quantized and stored_float32(path):
        return path
    config = json.loads((path / "config.json").read_text())
    config.pop("quantization", None)
    config.pop("quantization_config", None)
    save(dest, path, got.model, got.tokenizer, config)
    return dest


def stored_float32(path: Path) -> bool:
    import mlx.core as mx

    return all(v.dtype == mx.float32 for f in path.glob("*.safetensors")
               for v in _weights(f).values() if mx.issubdtype(v.dtype, mx.floating))


def _weights(f: Path) -> dict[str, Any]:
    import mlx.core as mx

    got = mx.load(str(f))  # a .safetensors file loads as a dict (mx.load's type says any)
    assert isinstance(got, dict)
    return got


def not_measurable(comparison: str, title: str, why: str, model: str) -> Run:
    return Run(new_run_id(), comparison, title, "", [], {}, 0, 0, 0, machine(model), [],
               not_measurable=why)


def ensure_worker_blas() -> None:
    """Re-exec with the workers' BLAS preloaded, or say why the numbers may be off."""
    from seatd.blas import find_openblas, loaded_blas, worker_env

    wanted = find_openblas()
    if wanted is None or loaded_blas() == "openblas":
        return
    if os.environ.get(REEXEC_FLAG):
        print("sanctum bench: warning: OpenBLAS preload did not take; in-process arms run "
              "on a different BLAS than the seats", file=sys.stderr)
        return
    env = dict(worker_env(dict(os.environ)), **{REEXEC_FLAG: "1"})
    os.execve(sys.executable, [sys.executable, "-m", "sanctum.cli", *sys.argv[1:]], env)
