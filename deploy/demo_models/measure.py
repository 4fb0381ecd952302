"""Reproduce the model card's numbers on this machine (MLX; run with OpenBLAS preloaded on Linux).

  LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 \\
    python deploy/demo_models/measure.py [--reference DIR] [--rounds 5] [--json FILE]

Held-out text: tests/data/heldout/*.py (standard-library files held out by the rule in
corpus.py). Models: builtin:demo and builtin:demo-drafter, loaded the way a seat loads
them on this device (seatd.model_load). Reports:
- perplexity of target and drafter (and of an unquantized reference with --reference);
- acceptance of the drafter against the target, teacher-forced on held-out text:
  greedy agreement (argmax equal), and at temperature 0.7 the expected per-token
  acceptance under rejection sampling, sum(min(p, q)), and under exact match, sum(p*q);
- with --decode-depths, acceptance in the seat's own speculative decode
  (seatd.decode, temperature 0, a pinned depth, no policy) on the same prompts as the
  benchmark: accepted over drafted tokens, and the rate at each draft position. At
  depth 1 that rate is the greedy acceptance on the target's own continuation;
- decode tok/s of each model alone (mlx-lm generate_step, temperature 0);
- an interleaved benchmark, A B A B: mlx-lm's generate_step against its
  speculative_generate_step with the pair, temperature 0, over code prompts cut from
  the held-out files; median and spread of tok/s per arm and of the per-round ratio.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from seatd.model_load import load_for_compute  # noqa: E402
from shared.builtin import resolve_model  # noqa: E402

HELDOUT = ROOT / "tests" / "data" / "heldout"
CHUNK = 1024


def heldout_ids(tokenizer: Any) -> list[list[int]]:
    eot = 0
    return [[*tokenizer.encode(p.read_text()), eot] for p in sorted(HELDOUT.glob("*.py"))]


def _logits(model: nn.Module, ids: list[int]) -> mx.array:
    return model(mx.array(ids)[None])[0].astype(mx.float32)


def perplexity(model: nn.Module, docs: list[list[int]]) -> float:
    nll, n = 0.0, 0
    for ids in docs:
        for s in range(0, len(ids) - 1, CHUNK):
            chunk = ids[s : s + CHUNK + 1]
            logits = _logits(model, chunk[:-1])
            y = mx.array(chunk[1:])
            nll += nn.losses.cross_entropy(logits, y, reduction="sum").item()
            n += len(chunk) - 1
    return math.exp(nll / n)


def acceptance(
    target: nn.Module, drafter: nn.Module, docs: list[list[int]], temp: float = 0.7
) -> dict[str, float]:
    greedy = rs = em = 0.0
    n = 0
    for ids in docs:
        for s in range(0, len(ids) - 1, CHUNK):
            x = ids[s : s + CHUNK]
            tl, dl = _logits(target, x), _logits(drafter, x)
            greedy += (tl.argmax(-1) == dl.argmax(-1)).sum().item()
            p, q = mx.softmax(tl / temp, axis=-1), mx.softmax(dl / temp, axis=-1)
            rs += mx.minimum(p, q).sum().item()
            em += (p * q).sum().item()
            n += len(x)
    return {
        "greedy": greedy / n,
        "t0.7_rejection": rs / n,
        "t0.7_exact_match": em / n,
        "positions": n,
    }


def decode_acceptance(
    target: Any, drafter: Any, depth: int, max_tokens: int, n_prompts: int
) -> dict[str, Any]:
    """Greedy speculation through seatd.decode at a pinned depth, counted over prompts."""
    from seatd.adaptive import DepthStats
    from seatd.decode import decode
    from seatd.drafters import ModelDrafter
    from seatd.engine_types import Speculation
    from shared.protocol import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    drafts = drafted = accepted = tokens = 0
    per_pos = [0] * depth
    for _name, ids in prompts(target.tokenizer, n_prompts):
        spec = Speculation(ModelDrafter(drafter.model), depth, DepthStats())
        res = decode(
            target.model,
            target.tokenizer,
            ids,
            params,
            kv="fp16",
            context_length=target.context_length,
            spec=spec,
        )
        r = res.speculation
        drafts += r.drafts
        drafted += r.draft_tokens
        accepted += r.accepted_tokens
        tokens += res.completion_tokens
        for i, n in enumerate(r.accepted_per_position):
            per_pos[i] += n
    return {
        "depth": depth,
        "prompts": n_prompts,
        "completion_tokens": tokens,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "accepted_over_drafted": accepted / max(drafted, 1),
        # Position i is drafted only when 0..i-1 were kept: its rate is conditional.
        "position_rate": [
            per_pos[i] / max(drafts if i == 0 else per_pos[i - 1], 1) for i in range(depth)
        ],
    }


def prompts(tokenizer: Any, n: int, chars: int = 1200) -> list[tuple[str, list[int]]]:
    out = []
    for p in sorted(HELDOUT.glob("*.py"))[:n]:
        text = p.read_text()
        cut = text[:chars]
        cut = cut[: cut.rfind("\n") + 1]
        out.append((p.name, tokenizer.encode(cut)))
    return out


def time_plain(model: nn.Module, prompt: list[int], max_tokens: int) -> float:
    from mlx_lm.generate import generate_step

    t = time.perf_counter()
    n = 0
    for _tok, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens):
        n += 1
    return n / (time.perf_counter() - t)


def time_spec(
    model: nn.Module, draft: nn.Module, prompt: list[int], max_tokens: int, k: int
) -> tuple[float, float]:
    from mlx_lm.generate import speculative_generate_step

    t = time.perf_counter()
    n = from_draft = 0
    for _tok, _, fd in speculative_generate_step(
        mx.array(prompt), model, draft, num_draft_tokens=k, max_tokens=max_tokens
    ):
        n += 1
        from_draft += int(fd)
    return n / (time.perf_counter() - t), from_draft / n


def _spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def interleaved(
    target: nn.Module,
    drafter: nn.Module,
    tokenizer: Any,
    rounds: int,
    k: int,
    max_tokens: int,
    n_prompts: int,
) -> dict[str, Any]:
    ps = prompts(tokenizer, n_prompts)
    time_plain(target, ps[0][1], 16)  # warm-up
    time_spec(target, drafter, ps[0][1], 16, k)
    rows: dict[str, Any] = {}
    all_ratio: list[float] = []
    for name, ids in ps:
        a, b, r, fd = [], [], [], []
        for _ in range(rounds):
            ta = time_plain(target, ids, max_tokens)
            tb, f = time_spec(target, drafter, ids, max_tokens, k)
            a.append(ta)
            b.append(tb)
            fd.append(f)
            r.append(tb / ta)
        all_ratio += r
        rows[name] = {
            "plain_tok_s": _spread(a),
            "spec_tok_s": _spread(b),
            "speedup": _spread(r),
            "from_draft": statistics.median(fd),
            "prompt_tokens": len(ids),
        }
    return {
        "num_draft_tokens": k,
        "rounds": rounds,
        "max_tokens": max_tokens,
        "prompts": rows,
        "speedup_all": _spread(all_ratio),
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--target", default="builtin:demo")
    ap.add_argument("--drafter", default="builtin:demo-drafter")
    ap.add_argument("--reference", default=None, help="unquantized target directory (not shipped)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument(
        "--draft-tokens", default="3", help="comma-separated num_draft_tokens to benchmark"
    )
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument(
        "--decode-depths",
        default="",
        help="comma-separated depths for the acceptance in seatd.decode (temperature 0)",
    )
    ap.add_argument("--skip-speed", action="store_true", help="no tok/s and no benchmark")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    out: dict[str, Any] = {"device": str(mx.default_device())}
    target = load_for_compute(resolve_model(args.target))
    drafter = load_for_compute(resolve_model(args.drafter))
    tm, dm, tk = target.model, drafter.model, target.tokenizer
    out["compute_dtype"] = {"target": target.compute_dtype, "drafter": drafter.compute_dtype}
    if not args.skip_quality:
        docs = heldout_ids(tk)
        out["heldout_tokens"] = sum(len(d) for d in docs)
        out["ppl_target_shipped"] = perplexity(tm, docs)
        out["ppl_drafter"] = perplexity(dm, docs)
        if args.reference:
            ref = load_for_compute(Path(args.reference))
            out["ppl_target_bf16_reference"] = perplexity(ref.model, docs)
            del ref
        out["acceptance"] = acceptance(tm, dm, docs)
        print(json.dumps(out, indent=1), flush=True)
    if args.decode_depths:
        out["decode_acceptance"] = [
            decode_acceptance(target, drafter, int(k), args.max_tokens, args.prompts)
            for k in args.decode_depths.split(",")
        ]
        print(json.dumps(out["decode_acceptance"], indent=1), flush=True)
    if args.skip_speed:
        _write(args.json, out)
        return
    ps = prompts(tk, 1)
    time_plain(tm, ps[0][1], 16)
    out["tok_s_target"] = statistics.median(
        time_plain(tm, ps[0][1], args.max_tokens) for _ in range(3)
    )
    out["tok_s_drafter"] = statistics.median(
        time_plain(dm, ps[0][1], args.max_tokens) for _ in range(3)
    )
    print(f"tok/s target {out['tok_s_target']:.1f} drafter {out['tok_s_drafter']:.1f}", flush=True)
    out["interleaved"] = []
    for k in (int(s) for s in args.draft_tokens.split(",") if s):
        res = interleaved(tm, dm, tk, args.rounds, k, args.max_tokens, args.prompts)
        out["interleaved"].append(res)
        print(f"k={k}", flush=True)
        for name, row in res["prompts"].items():
            print(
                f"  {name:32s} plain {row['plain_tok_s']['median']:6.1f}"
                f" spec {row['spec_tok_s']['median']:6.1f}"
                f" speedup {row['speedup']['median']:.2f}x"
                f" [{row['speedup']['min']:.2f}-{row['speedup']['max']:.2f}] "
                f"from_draft {row['from_draft']:.2f}",
                flush=True,
            )
        sa = res["speedup_all"]
        print(f"  all: median {sa['median']:.2f}x [{sa['min']:.2f}-{sa['max']:.2f}]", flush=True)
    _write(args.json, out)


def _write(path: str | None, out: dict[str, Any]) -> None:
    if path:
        Path(path).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
