"""Train the StarCoder2 demo pair: a target and a drafter distilled from it, in one run.

  python3 deploy/demo_models/train_sc2.py --work DIR --deadline 520 --reserve 40

One run of a GPU machine with no network (torch, transformers, tokenizers, numpy and
safetensors only). A third pair, of another architecture family than the llama pair:
``starcoder2`` (LayerNorm with bias, exact-GELU MLP ``c_fc``/``c_proj``, biased
projections, RoPE, grouped-query attention, tied embeddings, no sliding window), which
mlx-lm loads natively. In order, each stage fitted to the deadline (seconds from process
start, ``--reserve`` of them kept for evaluation and writing):

1. the demo corpus (corpus.py, the same files and held-out rule as the llama pair);
2. its own byte-level BPE tokenizer (tok.py's recipe and special tokens, TOKENIZER_VOCAB
   entries, ChatML template);
3. the target, with a cosine schedule fitted to the time left less ``--drafter-seconds``
   (sequence 1024, then 2048 for the last 30%); its held-out perplexity as trained and
   after the int8 crossing (transport.py);
4. the drafter, distilled from the crossed target's logits (forward KL at temperature 1)
   for ``--drafter-fraction`` of the target's steps, its schedule and warm-up fitted to
   that step count. It is time-safe: whichever of its step count and its time budget runs
   out first ends it (the schedule follows the further along of the two), and it is
   written with what it has;
5. held-out perplexity of both and the drafter's greedy agreement with the target.

Writes to DIR (every file under 16 MiB): tokenizer.json, tokenizer_config.json,
special_tokens_map.json; ``sc2_target_int8-0000N.safetensors`` (group-wise int8 shards
of at most SHARD_BYTES); ``sc2_drafter.safetensors`` (bfloat16); ``sc2_target_config.json``
and ``sc2_drafter_config.json`` (Hugging Face configs that mlx-lm reads too);
``sc2_target_reference.npz`` and ``sc2_drafter_reference.npz`` (float32 torch logits on the
first REFERENCE_TOKENS held-out tokens, weights as shipped to convert_sc2.py, for its
check); ``sc2_manifest.json`` (written after the target and again at the end) and
``sc2.log``.

``--return-dir OUT`` copies the run at the end, also after a failure, to OUT in at most
six files, for a return channel that takes few: the shards, the drafter, the two
references and ``sc2_small.tar`` (every .json and the log); convert_sc2.py reads that too.

On a shared GPU a step that runs out of memory is retried in micro-batches (gradient
accumulation), twice as many each time until it fits. A CPU smoke test:

  python deploy/demo_models/train_sc2.py --work W --batch 2 --seq 128 \\
      --max-steps 10 --steps 10 --max-site-bytes 2000000 --eval-tokens 2000
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tok as tok_mod
import train as base
import transport

TOKENIZER_VOCAB = 10240
ROPE_THETA = 10000.0
SHARD_BYTES = 14 * 1024 * 1024
REFERENCE_TOKENS = 128
SMALL_TAR = "sc2_small.tar"
SMALL_SUFFIXES = (".json", ".log")

# head_dim is hidden_size / num_attention_heads (64 in both): mlx-lm's starcoder2 derives it.
TARGET: dict[str, Any] = {
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "intermediate_size": 2048,
}
DRAFTER: dict[str, Any] = {
    "hidden_size": 192,
    "num_hidden_layers": 2,
    "num_attention_heads": 3,
    "num_key_value_heads": 1,
    "intermediate_size": 768,
}

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class _Tee(io.TextIOBase):
    """Write to a console stream and to the log file."""

    def __init__(self, console: TextIO, logfile: TextIO) -> None:
        self.console, self.logfile = console, logfile

    def write(self, s: str) -> int:
        self.console.write(s)
        self.logfile.write(s)
        self.console.flush()
        self.logfile.flush()
        return len(s)

    def flush(self) -> None:
        self.console.flush()
        self.logfile.flush()


def hf_config(arch: dict[str, Any], vocab: int) -> dict[str, Any]:
    """config.json for a starcoder2 model that both transformers and mlx-lm load.

    ``hidden_act`` is exact GELU, as mlx-lm's starcoder2 computes (``nn.gelu``) whatever
    the config says; mlx-lm reads ``rope_theta``, transformers 5 ``rope_parameters``.
    """
    return {
        "architectures": ["Starcoder2ForCausalLM"],
        "model_type": "starcoder2",
        "vocab_size": vocab,
        **arch,
        "hidden_act": "gelu",
        "max_position_embeddings": base.CONTEXT,
        "norm_epsilon": 1e-5,
        "rope_theta": ROPE_THETA,
        "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_THETA},
        "sliding_window": None,
        "use_bias": True,
        "attention_dropout": 0.0,
        "residual_dropout": 0.0,
        "embedding_dropout": 0.0,
        "tie_word_embeddings": True,
        "bos_token_id": None,
        "eos_token_id": [tok_mod.IM_END_ID, tok_mod.EOT_ID],
        "pad_token_id": tok_mod.EOT_ID,
        "torch_dtype": "bfloat16",
    }


def build_model(cfg: dict[str, Any]) -> torch.nn.Module:
    from transformers import Starcoder2Config, Starcoder2ForCausalLM

    skip = ("architectures", "model_type", "torch_dtype", "rope_theta")
    conf = Starcoder2Config(**{k: v for k, v in cfg.items() if k not in skip})
    conf._attn_implementation = "sdpa"
    return Starcoder2ForCausalLM(conf)


def load_weights(model: torch.nn.Module, weights: dict[str, np.ndarray]) -> torch.nn.Module:
    """Load tied-embedding weights (no lm_head) into a fresh model; refuse any mismatch."""
    sd = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in weights.items()}
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    res = model.load_state_dict(sd, strict=False)
    if res.unexpected_keys or [k for k in res.missing_keys if "rotary" not in k]:
        raise ValueError(f"weights do not fit the config: {res}")
    model.tie_weights()
    return model


# ---------------------------------------------------------------- steps


def lm_loss(model: torch.nn.Module, dev: torch.device) -> LossFn:
    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            logits = model(x).logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))

    return fn


def kl_loss(teacher: torch.nn.Module, drafter: torch.nn.Module, dev: torch.device) -> LossFn:
    """Forward KL(teacher || drafter) at temperature 1, mean over positions."""

    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        del y
        on = dev.type == "cuda"
        with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16, enabled=on):
            t_logp = F.log_softmax(teacher(x).logits.float(), dim=-1)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=on):
            d_logits = drafter(x).logits
        d_logp = F.log_softmax(d_logits.float(), dim=-1)
        return (t_logp.exp() * (t_logp - d_logp)).sum(-1).mean()

    return fn


def train_step(
    loss_fn: LossFn,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    split: int,
) -> tuple[torch.Tensor, int]:
    """One optimizer step over (x, y) in ``split`` micro-batches; (loss, split that fitted).

    When the GPU is short of memory (another process on it), the step is redone with twice
    as many micro-batches, down to one sequence each.
    """
    while True:
        opt.zero_grad(set_to_none=True)
        total = torch.zeros((), device=x.device)
        oom = False
        try:
            for xs, ys in zip(x.chunk(split), y.chunk(split), strict=True):
                loss = loss_fn(xs, ys) * (xs.shape[0] / x.shape[0])
                loss.backward()
                total += loss.detach()
        except torch.cuda.OutOfMemoryError:
            if split >= x.shape[0]:
                raise
            oom = True
        if not oom:
            break
        opt.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        split = min(x.shape[0], split * 2)
        base.log(f"out of GPU memory: retrying the step in {split} micro-batches")
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return total, split


def make_opt(model: torch.nn.Module, lr: float, wd: float, dev: torch.device) -> Any:
    return torch.optim.AdamW(
        model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=wd, fused=dev.type == "cuda"
    )


# ---------------------------------------------------------------- files


def save_int8_shards(state: dict[str, np.ndarray], work: Path, stem: str) -> list[str]:
    """transport.pack'd tensors in safetensors files of at most SHARD_BYTES each."""
    from safetensors.numpy import save_file

    for old in work.glob(f"{stem}-*.safetensors"):
        old.unlink()
    packed = transport.pack(state)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for k, v in packed.items():
        if size + v.nbytes > SHARD_BYTES and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += v.nbytes
    names = []
    for i, shard in enumerate(shards):
        name = f"{stem}-{i:05d}.safetensors"
        save_file(shard, str(work / name))
        names.append(name)
    return names


def bf16_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: v.detach().to(torch.bfloat16).contiguous().cpu()
        for k, v in model.state_dict().items()
        if k != "lm_head.weight"  # tied to the embedding
    }


def save_reference(
    cfg: dict[str, Any], weights: dict[str, torch.Tensor], ids: np.ndarray, path: Path
) -> None:
    """float32 logits, on this CPU, of the model with exactly the weights that ship."""
    model = load_weights(build_model(cfg), {k: v.float().numpy() for k, v in weights.items()})
    model = model.float().eval()
    with torch.no_grad():
        logits = model(torch.from_numpy(ids.astype(np.int64))[None]).logits[0].float().numpy()
    np.savez_compressed(path, ids=ids.astype(np.int32), logits=logits)


def copy_back(work: Path, dest: Path) -> list[str]:
    """The run's files in at most six: big ones as they are, the small ones in SMALL_TAR.

    For a return channel that takes few files (the weights, the references and one tar of
    the tokenizer files, configs, manifest and log); convert_sc2.py reads either layout.
    """
    import shutil
    import tarfile

    dest.mkdir(parents=True, exist_ok=True)
    names = []
    small = [p for p in sorted(work.iterdir()) if p.is_file() and p.suffix in SMALL_SUFFIXES]
    with tarfile.open(dest / SMALL_TAR, "w") as tar:
        for p in small:
            tar.add(p, arcname=p.name)
    names.append(SMALL_TAR)
    for p in sorted(work.iterdir()):
        if p.is_file() and p.suffix in (".safetensors", ".npz"):
            shutil.copy(p, dest / p.name)
            names.append(p.name)
    return names


def file_sizes(work: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(work.iterdir()) if p.is_file()}


# ---------------------------------------------------------------- run


def run(args: argparse.Namespace) -> None:
    from safetensors.torch import save_file

    work: Path = args.work
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    timings: dict[str, float] = {}

    def left() -> float:
        return args.deadline - (time.time() - base.T0) - args.reserve

    tk, c, stats = base.prepare(
        work,
        train_tokenizer=True,
        max_site_bytes=args.max_site_bytes,
        vocab_size=TOKENIZER_VOCAB,
    )
    stream, tstats = base.tokenize_corpus(tk, c)
    held = base.heldout_stream(tk, c)
    if args.eval_tokens:
        held = held[: args.eval_tokens]
    timings["prepare"] = round(time.time() - base.T0, 1)
    vocab = tk.get_vocab_size()
    base.log(f"tokens: train {len(stream):,} ({tstats}), heldout {len(held):,}, vocab {vocab}")
    manifest: dict[str, Any] = {
        "corpus": stats,
        "tokens": {"train": len(stream), "heldout": len(held), **tstats},
        "chat_pairs_found": len(c.chat_pairs),
        "heldout_files": sorted(f.relpath for f in c.heldout),
        "tokenizer": {"vocab_size": vocab, "special_tokens": tok_mod.SPECIAL_TOKENS},
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "versions": versions(dev),
    }

    # ---- target
    torch.manual_seed(0)
    t_cfg = hf_config(TARGET, vocab)
    model = build_model(t_cfg).to(dev)
    base.log(f"target params {base.n_params(model):,}")
    opt = make_opt(model, args.lr, 0.1, dev)
    batches = base.Batches(stream, dev, seed=1)
    tokens_per_step = args.batch * args.seq
    budget = max(1.0, left() - args.drafter_seconds)
    base.log(f"target budget {budget:.0f}s, {tokens_per_step} tokens/step")
    loss_fn = lm_loss(model, dev)
    t_start, step, seen, split = time.time(), 0, 0, 1
    while True:
        progress, done = base.schedule_progress(step, t_start, budget, args.steps)
        if done or (args.max_steps and step >= args.max_steps):
            break
        seq = args.seq if progress < 0.7 else base.CONTEXT
        bsz = max(1, tokens_per_step // seq)
        for g in opt.param_groups:
            g["lr"] = base.lr_at(step, progress, args.lr, args.warmup)
        x, y = batches.get(bsz, seq)
        loss, split = train_step(loss_fn, model, opt, x, y, split)
        step += 1
        seen += x.numel()
        if step % 100 == 0 or step == 1:
            base.log(
                f"step {step} p={progress:.3f} seq={seq} loss={loss.item():.4f}"
                f" tok/s={seen / (time.time() - t_start):,.0f}"
            )
    train_s = time.time() - t_start
    ev = base.eval_heldout(model, held, dev)
    base.log(f"target done: {step} steps, {seen:,} tokens, {train_s:.0f}s; heldout {ev}")
    peak_gib = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else 0.0
    base.log(f"peak GPU memory {peak_gib:.1f} GiB")
    t_params = base.n_params(model)
    shards = save_int8_shards(base.state_numpy(model), work, "sc2_target_int8")
    (work / "sc2_target_config.json").write_text(json.dumps(t_cfg, indent=2) + "\n")
    del model, opt, loss_fn
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    # The teacher is the target as it crosses (int8), as train.py's drafters stage does.
    crossed = transport.load_packed(*(work / name for name in shards))
    teacher = load_weights(build_model(t_cfg), crossed).to(dev).to(torch.bfloat16).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    ev_crossed = base.eval_heldout(teacher, held, dev)
    base.log(f"target after the int8 crossing: heldout {ev_crossed}")
    timings["target"] = round(time.time() - base.T0 - timings["prepare"], 1)
    manifest["target"] = {
        "config": t_cfg,
        "params": t_params,
        "shards": shards,
        "steps": step,
        "tokens_seen": seen,
        "train_seconds": round(train_s, 1),
        "budget_seconds": round(budget, 1),
        "peak_lr": args.lr,
        "warmup": args.warmup,
        "schedule_steps": args.steps or None,
        "tokens_per_step": tokens_per_step,
        "micro_batches": split,
        "peak_gpu_gib": round(peak_gib, 1),
        "seq": [args.seq, base.CONTEXT],
        "heldout_bf16_torch": ev,
        "heldout_after_int8": ev_crossed,
    }
    manifest["timings"] = timings
    (work / "sc2_manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    ref_ids = held[:REFERENCE_TOKENS]
    save_reference(
        t_cfg,
        {k: torch.from_numpy(v).to(torch.bfloat16) for k, v in crossed.items()},
        ref_ids,
        work / "sc2_target_reference.npz",
    )
    del crossed

    # ---- drafter
    d_steps = max(1, round(step * args.drafter_fraction))
    d_warmup = max(1, min(round(args.warmup * d_steps / max(step, 1)), d_steps // 5))
    torch.manual_seed(10)
    d_cfg = hf_config(DRAFTER, vocab)
    drafter = build_model(d_cfg).to(dev)
    base.log(f"drafter params {base.n_params(drafter):,}")
    d_opt = make_opt(drafter, args.drafter_lr, 0.05, dev)
    d_batches = base.Batches(stream, dev, seed=2)
    d_budget = left()
    base.log(f"drafter: {d_steps} steps (warm-up {d_warmup}) within {d_budget:.0f}s")
    d_loss_fn = kl_loss(teacher, drafter, dev)
    t_start, d_step, d_seen, split = time.time(), 0, 0, 1
    while d_step < d_steps:
        elapsed = (time.time() - t_start) / max(d_budget, 1e-9)
        if elapsed >= 1.0:
            base.log(f"drafter: out of time after {d_step} of {d_steps} steps")
            break
        # Time-safe: a slow GPU moves the schedule on by time, so the LR still decays.
        progress = max(d_step / d_steps, elapsed)
        seq = args.seq if progress < 0.7 else base.CONTEXT
        bsz = max(1, tokens_per_step // seq)
        for g in d_opt.param_groups:
            g["lr"] = base.lr_at(d_step, progress, args.drafter_lr, d_warmup)
        x, y = d_batches.get(bsz, seq)
        kl, split = train_step(d_loss_fn, drafter, d_opt, x, y, split)
        d_step += 1
        d_seen += x.numel()
        if d_step % 50 == 0 or d_step == 1 or d_step == d_steps:
            base.log(
                f"drafter step {d_step} p={progress:.3f} seq={seq} kl={kl.item():.4f}"
                f" tok/s={d_seen / (time.time() - t_start):,.0f}"
            )
    d_train_s = time.time() - t_start
    d_weights = bf16_weights(drafter)
    save_file(d_weights, str(work / "sc2_drafter.safetensors"), metadata={"format": "pt"})
    (work / "sc2_drafter_config.json").write_text(json.dumps(d_cfg, indent=2) + "\n")
    base.log("drafter written")
    d_ev = base.eval_heldout(teacher, held, dev, {"drafter": drafter})
    base.log(f"drafter done: {d_step} steps, {d_seen:,} tokens, {d_train_s:.0f}s; heldout {d_ev}")
    save_reference(d_cfg, d_weights, ref_ids, work / "sc2_drafter_reference.npz")
    timings["drafter"] = round(time.time() - base.T0 - timings["prepare"] - timings["target"], 1)
    manifest["drafter"] = {
        "config": d_cfg,
        "params": base.n_params(drafter),
        "steps": d_step,
        "schedule_steps": d_steps,
        "fraction_of_target_steps": args.drafter_fraction,
        "tokens_seen": d_seen,
        "train_seconds": round(d_train_s, 1),
        "budget_seconds": round(d_budget, 1),
        "peak_lr": args.drafter_lr,
        "warmup": d_warmup,
        "weight_decay": 0.05,
        "micro_batches": split,
        "loss": "forward KL to the int8-crossed target's logits, temperature 1",
        "heldout_torch": {
            "ppl": d_ev["drafter_ppl"],
            "greedy_agreement": d_ev["drafter_agreement"],
            "target_ppl": d_ev["ppl"],
            "heldout_tokens": d_ev["heldout_tokens"],
        },
    }
    manifest["reference_tokens"] = len(ref_ids)
    timings["total"] = round(time.time() - base.T0, 1)
    manifest["files"] = file_sizes(work)
    (work / "sc2_manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    base.log(f"all written in {timings['total']:.0f}s: {json.dumps(manifest['files'])}")


def versions(dev: torch.device) -> dict[str, str]:
    import tokenizers
    import transformers

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "python": sys.version.split()[0],
        "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--work", required=True, type=Path)
    ap.add_argument(
        "--deadline",
        type=float,
        default=520.0,
        help="seconds from start by which everything is written",
    )
    ap.add_argument(
        "--reserve",
        type=float,
        default=40.0,
        help="seconds kept for the final evaluation and writing",
    )
    ap.add_argument(
        "--drafter-seconds",
        type=float,
        default=80.0,
        help="seconds kept from the target's budget for the int8 crossing and the drafter",
    )
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--drafter-lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=200, help="target warm-up steps")
    ap.add_argument(
        "--drafter-fraction",
        type=float,
        default=0.1,
        help="drafter steps as a fraction of the target's",
    )
    ap.add_argument(
        "--max-steps", type=int, default=0, help="stop the target after N (smoke tests)"
    )
    ap.add_argument(
        "--steps",
        type=int,
        default=0,
        help="fit the target's schedule to N steps rather than to the time budget",
    )
    ap.add_argument(
        "--eval-tokens", type=int, default=0, help="cap on held-out tokens evaluated (smoke tests)"
    )
    ap.add_argument(
        "--max-site-bytes", type=int, default=260_000_000, help="cap on site-packages text"
    )
    ap.add_argument(
        "--return-dir",
        type=Path,
        default=None,
        help=f"at the end, copy the run here in at most six files ({SMALL_TAR})",
    )
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    args.work.mkdir(parents=True, exist_ok=True)
    logfile = (args.work / "sc2.log").open("w", encoding="utf-8")
    sys.stdout = _Tee(sys.__stdout__, logfile)
    sys.stderr = _Tee(sys.__stderr__, logfile)
    try:
        run(args)
    except BaseException:
        traceback.print_exc()  # into the log too
        raise
    finally:
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
        logfile.close()
        if args.return_dir is not None:  # also after a failure: the log at least
            print(f"copied to {args.return_dir}: {copy_back(args.work, args.return_dir)}")


if __name__ == "__main__":
    main()
