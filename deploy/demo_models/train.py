"""Train the demo target and distil its drafters (torch, transformers, tokenizers only).

Two stages, each one run of a GPU machine with no network:

  python3 deploy/demo_models/train.py target  --work DIR --deadline SECONDS
  python3 deploy/demo_models/train.py drafters --work DIR --deadline SECONDS

``target`` builds the corpus (corpus.py), trains the tokenizer (tok.py), trains the
target with a cosine schedule fitted to the time budget (sequence 1024, then 2048 for
the last 30% so that the served context of 2048 is one it was trained at), measures
held-out perplexity and writes the tokenizer, an int8 transport copy of the target
(transport.py), held-out samples and a manifest to DIR.

``drafters`` reads DIR, rebuilds the same corpus, and distils the drafters of
DEFAULT_DRAFTERS (or ``--only``'s, from DRAFTERS) at once from the target's logits
(forward KL at temperature 1; one teacher forward per batch serves all of them), then
writes each in bfloat16 with its held-out greedy agreement. The deadline is seconds
from process start; each stage fits its training to what is left, unless ``--steps N``
fits the schedule to N steps instead.

``drafters --teacher DIR`` distils from an MLX model directory instead of DIR's int8
copy (the shipped, quantized target: ``shared/models/demo``; mlx_weights.py reads it
without MLX) and tokenizes with that directory's tokenizer. The weak benchmark drafter
``builtin:demo-drafter-weak`` is made so: the shipped drafter's recipe for a fifth of its
steps (a tenth left it at 26% greedy agreement; shared/models/README.md has the sweep):

  python3 deploy/demo_models/train.py drafters --work W --out W --teacher shared/models/demo \
      --only d192x4 --steps 810 --warmup 40 --deadline 300 --reserve 40
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import corpus as corpus_mod
import mlx_weights
import tok as tok_mod
import transport

T0 = time.time()
CONTEXT = 2048

TARGET: dict[str, Any] = {
    "hidden_size": 576,
    "num_hidden_layers": 10,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "intermediate_size": 1536,
}
DRAFTERS: dict[str, dict[str, Any]] = {
    "d192x2": {
        "hidden_size": 192,
        "num_hidden_layers": 2,
        "num_attention_heads": 3,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "intermediate_size": 512,
    },
    "d192x4": {
        "hidden_size": 192,
        "num_hidden_layers": 4,
        "num_attention_heads": 3,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "intermediate_size": 512,
    },
    "d256x2": {
        "hidden_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "intermediate_size": 768,
    },
    # One layer: a candidate for the weak benchmark drafter, never distilled by default.
    "d192x1": {
        "hidden_size": 192,
        "num_hidden_layers": 1,
        "num_attention_heads": 3,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "intermediate_size": 512,
    },
}
DEFAULT_DRAFTERS = ("d192x2", "d192x4", "d256x2")


def log(msg: str) -> None:
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


def hf_config(arch: dict[str, Any], vocab: int) -> dict[str, Any]:
    """config.json for a llama model that both transformers and mlx-lm load."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        **arch,
        "hidden_act": "silu",
        "max_position_embeddings": CONTEXT,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "bos_token_id": None,
        "eos_token_id": [tok_mod.IM_END_ID, tok_mod.EOT_ID],
        "pad_token_id": tok_mod.EOT_ID,
        "torch_dtype": "bfloat16",
    }


def build_model(cfg: dict[str, Any]) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    conf = LlamaConfig(
        **{k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "torch_dtype")}
    )
    conf._attn_implementation = "sdpa"
    return LlamaForCausalLM(conf)


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def state_numpy(model: torch.nn.Module) -> dict[str, np.ndarray]:
    sd = {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}
    sd.pop("lm_head.weight", None)  # tied to the embedding
    return sd


# ---------------------------------------------------------------- data


def tokenize_corpus(
    tk: Any, c: corpus_mod.Corpus, chat_ratio_cap: float = 0.08
) -> tuple[np.ndarray, dict[str, Any]]:
    """All training files and chat pairs as one token stream, documents ended by <|endoftext|>."""
    texts = [f.text for f in c.train]
    chats = [corpus_mod.chat_text(u, a) for u, a in c.chat_pairs]
    ids: list[np.ndarray] = []
    n_code = 0
    for i in range(0, len(texts), 4096):
        for enc in tk.encode_batch(texts[i : i + 4096]):
            ids.append(np.asarray([*enc.ids, tok_mod.EOT_ID], dtype=np.uint16))
            n_code += len(enc.ids) + 1
    n_chat = 0
    chat_ids: list[np.ndarray] = []
    for i in range(0, len(chats), 4096):
        for enc in tk.encode_batch(chats[i : i + 4096]):
            if n_chat > chat_ratio_cap * n_code:
                break
            chat_ids.append(np.asarray([*enc.ids, tok_mod.EOT_ID], dtype=np.uint16))
            n_chat += len(enc.ids) + 1
    docs = ids + chat_ids
    order = np.random.default_rng(0).permutation(len(docs))
    stream = np.concatenate([docs[j] for j in order])
    return stream, {"code_tokens": n_code, "chat_tokens": n_chat, "chat_pairs_used": len(chat_ids)}


def heldout_stream(tk: Any, c: corpus_mod.Corpus) -> np.ndarray:
    encs = tk.encode_batch([f.text for f in c.heldout])
    return np.concatenate([np.asarray([*e.ids, tok_mod.EOT_ID], dtype=np.int64) for e in encs])


class Batches:
    """Random windows of a token stream held on the GPU."""

    def __init__(self, stream: np.ndarray, device: torch.device, seed: int) -> None:
        self.data = torch.from_numpy(stream.astype(np.int32)).to(device)
        self.gen = torch.Generator(device=device)
        self.gen.manual_seed(seed)
        self.device = device

    def get(self, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.data.numel() - seq - 1
        starts = torch.randint(0, n, (batch,), device=self.device, generator=self.gen)
        idx = starts[:, None] + torch.arange(seq + 1, device=self.device)[None, :]
        w = self.data[idx].long()
        return w[:, :-1], w[:, 1:]


def schedule_progress(step: int, t_start: float, budget: float, steps: int) -> tuple[float, bool]:
    """(progress through the schedule, stop?): over a fixed step count, or the time budget.

    With a step count the time budget still stops the run, so a slow machine cannot
    overrun its deadline; the log then shows fewer steps than asked for.
    """
    elapsed = (time.time() - t_start) / budget
    if steps:
        return step / steps, step >= steps or elapsed >= 1.0
    return elapsed, elapsed >= 1.0


def lr_at(step: int, progress: float, peak: float, warmup: int) -> float:
    warm = min(1.0, (step + 1) / warmup)
    return peak * warm * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


@torch.no_grad()
def eval_heldout(
    model: torch.nn.Module,
    stream: np.ndarray,
    device: torch.device,
    drafters: dict[str, torch.nn.Module] | None = None,
) -> dict[str, float]:
    """Mean NLL of the model on held-out windows of CONTEXT; drafters' greedy agreement with it."""
    model.eval()
    nll, count = 0.0, 0
    agree = {k: 0 for k in (drafters or {})}
    d_nll = {k: 0.0 for k in (drafters or {})}
    for s in range(0, len(stream) - 1, CONTEXT):
        chunk = torch.from_numpy(stream[s : s + CONTEXT + 1]).to(device)[None]
        x, y = chunk[:, :-1], chunk[:, 1:]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(x).logits.float()
        nll += F.cross_entropy(logits[0], y[0], reduction="sum").item()
        count += y.numel()
        if drafters:
            t_arg = logits.argmax(-1)
            for k, d in drafters.items():
                d.eval()
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
                    dl = d(x).logits.float()
                agree[k] += (dl.argmax(-1) == t_arg).sum().item()
                d_nll[k] += F.cross_entropy(dl[0], y[0], reduction="sum").item()
                d.train()
    model.train()
    out = {"heldout_tokens": count, "ppl": math.exp(nll / count)}
    for k in agree:
        out[f"{k}_agreement"] = agree[k] / count
        out[f"{k}_ppl"] = math.exp(d_nll[k] / count)
    return out


# ---------------------------------------------------------------- stages


def prepare(
    work: Path,
    train_tokenizer: bool,
    max_site_bytes: int | None = None,
    tok_dir: Path | None = None,
    vocab_size: int = tok_mod.VOCAB_SIZE,
) -> tuple[Any, corpus_mod.Corpus, dict[str, Any]]:
    from tokenizers import Tokenizer

    workers = max(1, min(16, os.cpu_count() or 1))
    c = corpus_mod.collect(max_site_bytes=max_site_bytes, workers=workers)
    log(f"corpus: {json.dumps({k: v for k, v in c.stats.items() if k != 'site_packages_top'})}")
    rng = np.random.default_rng(0)
    chat_src = [f for f in c.train if f.origin == "stdlib" or rng.random() < 0.2]
    c.chat_pairs = corpus_mod.chat_pairs(chat_src, workers=workers)
    log(f"chat pairs: {len(c.chat_pairs)}")
    if train_tokenizer:
        rng = np.random.default_rng(0)
        sample = [f.text for f in c.train if f.origin == "stdlib" or rng.random() < 0.15]
        sample += [corpus_mod.chat_text(u, a) for u, a in c.chat_pairs[:2000]]
        budget, picked = 80_000_000, []
        for t in sample:
            budget -= len(t)
            if budget < 0:
                break
            picked.append(t)
        tk = tok_mod.train_tokenizer(picked, vocab_size)
        tok_mod.write_tokenizer_files(tk, work)
        log(f"tokenizer trained on {len(picked)} texts, vocab {tk.get_vocab_size()}")
    tk = Tokenizer.from_file(str((tok_dir or work) / "tokenizer.json"))
    return tk, c, dict(c.stats)


def save_heldout_samples(c: corpus_mod.Corpus, out: Path, budget: int = 60_000) -> list[str]:
    """A few small held-out non-test stdlib files, for tests and CPU measurements."""
    out.mkdir(parents=True, exist_ok=True)
    cands = [
        f
        for f in c.heldout
        if not f.relpath.startswith(("test/", "idlelib/idle_test"))
        and 2_000 <= len(f.text) <= 14_000
    ]
    cands.sort(key=lambda f: hashlib.sha256(f.relpath.encode()).hexdigest())
    names: list[str] = []
    for f in cands:
        if budget - len(f.text) < 0:
            continue
        budget -= len(f.text)
        name = f.relpath.replace("/", "__")
        (out / name).write_text(f.text, encoding="utf-8")
        names.append(f.relpath)
    return names


def stage_target(args: argparse.Namespace) -> None:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tk, c, stats = prepare(work, train_tokenizer=True, max_site_bytes=args.max_site_bytes)
    stream, tstats = tokenize_corpus(tk, c)
    held = heldout_stream(tk, c)
    if args.eval_tokens:
        held = held[: args.eval_tokens]
    log(f"tokens: train {len(stream):,} ({tstats}), heldout {len(held):,}")
    samples = save_heldout_samples(c, work / "heldout")
    torch.manual_seed(0)
    cfg = hf_config(TARGET, tk.get_vocab_size())
    model = build_model(cfg).to(dev)
    log(f"target params {n_params(model):,}")
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=args.lr,
        betas=(0.9, 0.95),
        weight_decay=0.1,
        fused=dev.type == "cuda",
    )
    batches = Batches(stream, dev, seed=1)
    tokens_per_step = args.batch * args.seq
    budget = args.deadline - (time.time() - T0) - args.reserve
    log(f"training budget {budget:.0f}s, {tokens_per_step} tokens/step")
    t_start, step, seen = time.time(), 0, 0
    while True:
        progress, done = schedule_progress(step, t_start, budget, args.steps)
        if done or (args.max_steps and step >= args.max_steps):
            break
        seq = args.seq if progress < 0.7 else CONTEXT
        bsz = max(1, tokens_per_step // seq)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, progress, args.lr, args.warmup)
        x, y = batches.get(bsz, seq)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            logits = model(x).logits
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        seen += x.numel()
        if step % 100 == 0 or step == 1:
            el = time.time() - t_start
            log(
                f"step {step} p={progress:.3f} seq={seq} loss={loss.item():.4f}"
                f" tok/s={seen / el:,.0f}"
            )
    train_s = time.time() - t_start
    ev = eval_heldout(model, held, dev)
    log(f"target done: {step} steps, {seen:,} tokens, {train_s:.0f}s; heldout {ev}")
    transport.save_packed(state_numpy(model), work / "target_int8.safetensors")
    (work / "target_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    import tokenizers
    import transformers

    manifest = {
        "corpus": stats,
        "tokens": {"train": len(stream), "heldout": len(held), **tstats},
        "chat_pairs_found": len(c.chat_pairs),
        "heldout_samples": samples,
        "heldout_files": sorted(f.relpath for f in c.heldout),
        "target": {
            "params": n_params(model),
            "steps": step,
            "tokens_seen": seen,
            "train_seconds": round(train_s, 1),
            "peak_lr": args.lr,
            "tokens_per_step": tokens_per_step,
            "seq": [args.seq, CONTEXT],
            "heldout_bf16_torch": ev,
        },
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
            "python": sys.version.split()[0],
            "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        },
    }
    (work / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    log("stage target written")


def load_target(
    work: Path, dev: torch.device, teacher: Path | None = None
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The target from WORK's int8 copy, or from an MLX model directory (dequantized)."""
    if teacher is None:
        cfg = json.loads((work / "target_config.json").read_text())
        weights = transport.load_packed(work / "target_int8.safetensors")
    else:
        weights, cfg = mlx_weights.load_model_weights(teacher)
    model = build_model(cfg)
    sd = {k: torch.from_numpy(v) for k, v in weights.items()}
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    res = model.load_state_dict(sd, strict=False)
    if res.unexpected_keys or [k for k in res.missing_keys if "rotary" not in k]:
        raise ValueError(f"target weights do not fit its config: {res}")
    model.tie_weights()
    return model.to(dev).to(torch.bfloat16).eval(), cfg


def stage_drafters(args: argparse.Namespace) -> None:
    from safetensors.torch import save_file

    work = Path(args.work)
    out = Path(args.out or args.work)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    teacher_dir = Path(args.teacher) if args.teacher else None
    tk, c, _ = prepare(
        work, train_tokenizer=False, max_site_bytes=args.max_site_bytes, tok_dir=teacher_dir
    )
    stream, _ = tokenize_corpus(tk, c)
    held = heldout_stream(tk, c)
    if args.eval_tokens:
        held = held[: args.eval_tokens]
    log(f"tokens: train {len(stream):,}, heldout {len(held):,}")
    teacher, _ = load_target(work, dev, teacher_dir)
    for p in teacher.parameters():
        p.requires_grad_(False)
    names = args.only.split(",") if args.only else list(DEFAULT_DRAFTERS)
    drafters, opts, cfgs = {}, {}, {}
    for i, name in enumerate(names):
        torch.manual_seed(10 + i)
        cfgs[name] = hf_config(DRAFTERS[name], tk.get_vocab_size())
        drafters[name] = build_model(cfgs[name]).to(dev)
        opts[name] = torch.optim.AdamW(
            drafters[name].parameters(),
            lr=args.lr,
            betas=(0.9, 0.95),
            weight_decay=0.05,
            fused=dev.type == "cuda",
        )
        log(f"drafter {name} params {n_params(drafters[name]):,}")
    batches = Batches(stream, dev, seed=2)
    tokens_per_step = args.batch * args.seq
    budget = args.deadline - (time.time() - T0) - args.reserve
    log(f"distillation budget {budget:.0f}s, {tokens_per_step} tokens/step")
    t_start, step, seen = time.time(), 0, 0
    while True:
        progress, done = schedule_progress(step, t_start, budget, args.steps)
        if done or (args.max_steps and step >= args.max_steps):
            break
        seq = args.seq if progress < 0.7 else CONTEXT
        bsz = max(1, tokens_per_step // seq)
        x, _ = batches.get(bsz, seq)
        with (
            torch.no_grad(),
            torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"),
        ):
            t_logp = F.log_softmax(teacher(x).logits.float(), dim=-1).view(
                -1, teacher.config.vocab_size
            )
        t_p = t_logp.exp()
        losses = []
        for name, d in drafters.items():
            for g in opts[name].param_groups:
                g["lr"] = lr_at(step, progress, args.lr, args.warmup)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                d_logits = d(x).logits
            d_logp = F.log_softmax(d_logits.float(), dim=-1).view_as(t_logp)
            loss = (t_p * (t_logp - d_logp)).sum(-1).mean()
            opts[name].zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(d.parameters(), 1.0)
            opts[name].step()
            losses.append(f"{name}={loss.item():.4f}")
        step += 1
        seen += x.numel()
        if step % 100 == 0 or step == 1:
            el = time.time() - t_start
            log(
                f"step {step} p={progress:.3f} seq={seq} kl {' '.join(losses)}"
                f" tok/s={seen / el:,.0f}"
            )
    train_s = time.time() - t_start
    ev = eval_heldout(teacher, held, dev, drafters)
    log(f"distillation done: {step} steps, {seen:,} tokens, {train_s:.0f}s; heldout {ev}")
    result: dict[str, Any] = {
        "steps": step,
        "tokens_seen": seen,
        "train_seconds": round(train_s, 1),
        "peak_lr": args.lr,
        "warmup": args.warmup,
        "schedule_steps": args.steps or None,
        "teacher": str(teacher_dir) if teacher_dir else "target_int8.safetensors",
        "tokens_per_step": tokens_per_step,
        "heldout_torch": ev,
        "versions": {
            "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        },
        "drafters": {},
    }
    for name, d in drafters.items():
        sd = {
            k: v.detach().to(torch.bfloat16).contiguous()
            for k, v in d.state_dict().items()
            if k != "lm_head.weight"
        }
        save_file(sd, str(out / f"drafter_{name}.safetensors"))
        (out / f"drafter_{name}_config.json").write_text(json.dumps(cfgs[name], indent=2) + "\n")
        result["drafters"][name] = {"params": n_params(d), **DRAFTERS[name]}
    (out / "drafters_manifest.json").write_text(json.dumps(result, indent=2) + "\n")
    log("stage drafters written")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("stage", choices=["target", "drafters"])
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--deadline", type=float, default=560.0, help="seconds from start by which to be done"
    )
    ap.add_argument(
        "--reserve", type=float, default=25.0, help="seconds kept for evaluation and export"
    )
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--max-steps", type=int, default=0)
    ap.add_argument(
        "--steps",
        type=int,
        default=0,
        help="fit the LR schedule and the 2048-token phase to this many steps, not the time budget",
    )
    ap.add_argument(
        "--teacher",
        default=None,
        help="drafters: distil from this MLX model directory (its tokenizer too), not WORK's",
    )
    ap.add_argument(
        "--eval-tokens", type=int, default=0, help="cap on held-out tokens evaluated (smoke tests)"
    )
    ap.add_argument(
        "--max-site-bytes",
        type=int,
        default=260_000_000,
        help="cap on site-packages text (smoke tests)",
    )
    ap.add_argument("--only", default="", help="comma-separated drafter names")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    if args.lr is None:
        args.lr = 2e-3 if args.stage == "target" else 3e-3
    stage_target(args) if args.stage == "target" else stage_drafters(args)


if __name__ == "__main__":
    main()
