"""Train the hybrid demo target: a small qwen3_next (gated-delta layers plus full attention).

  python3 deploy/demo_models/train_hybrid.py --work DIR --tokenizer shared/models/demo \\
      --deadline SECONDS

It reuses the demo pair's corpus (corpus.py, same files, same held-out rule) and the
demo's committed tokenizer unchanged, so the demo drafter and the lookup drafter serve it
too. Three of every four layers are gated-delta linear attention with a recurrent state;
every fourth is full attention with a KV cache (qwen3_next's ``full_attention_interval``).
The MLPs are dense (no experts). Training uses transformers' own Qwen3Next, in bfloat16
autocast, with a cosine schedule fitted to the time budget (sequence 1024, then 2048 for
the last 30%).

Writes to DIR: the bfloat16 weights as Hugging Face tensors in shards of at most 14 MiB
(``hybrid-0000N.safetensors``), ``hybrid_manifest.json`` (config, held-out perplexity,
training record) and ``hybrid_reference.npz``: float32 logits on the first 128 held-out
tokens of the trained model with its weights rounded to bfloat16 as shipped, which
convert_hybrid.py compares against the converted MLX model.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tok as tok_mod
import train as base

HYBRID: dict[str, Any] = {
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "full_attention_interval": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "intermediate_size": 1024,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4,
}
ROPE_THETA = 10000.0
PARTIAL_ROTARY = 0.25
SHARD_BYTES = 14 * 1024 * 1024
REFERENCE_TOKENS = 128


def mlx_config(vocab: int) -> dict[str, Any]:
    """config.json as mlx-lm's qwen3_next reads it (dense MLPs: no experts)."""
    return {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "vocab_size": vocab,
        **HYBRID,
        "hidden_act": "silu",
        "max_position_embeddings": base.CONTEXT,
        "rms_norm_eps": 1e-6,
        "rope_theta": ROPE_THETA,
        "partial_rotary_factor": PARTIAL_ROTARY,
        "attention_bias": False,
        "tie_word_embeddings": True,
        "num_experts": 0,
        "num_experts_per_tok": 0,
        "decoder_sparse_step": 1,
        "moe_intermediate_size": 0,
        "shared_expert_intermediate_size": 0,
        "mlp_only_layers": [],
        "norm_topk_prob": False,
        "bos_token_id": None,
        "eos_token_id": [tok_mod.IM_END_ID, tok_mod.EOT_ID],
        "pad_token_id": tok_mod.EOT_ID,
        "torch_dtype": "bfloat16",
    }


def build_model(vocab: int) -> torch.nn.Module:
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    arch = dict(HYBRID)
    interval = arch.pop("full_attention_interval")
    layer_types = [
        "linear_attention" if (i + 1) % interval else "full_attention"
        for i in range(arch["num_hidden_layers"])
    ]
    conf = Qwen3NextConfig(
        vocab_size=vocab,
        **arch,
        layer_types=layer_types,
        max_position_embeddings=base.CONTEXT,
        rms_norm_eps=1e-6,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": ROPE_THETA,
            "partial_rotary_factor": PARTIAL_ROTARY,
        },
        tie_word_embeddings=True,
        num_experts=0,
        num_experts_per_tok=0,
        mlp_only_layers=[],
        eos_token_id=[tok_mod.IM_END_ID, tok_mod.EOT_ID],
        pad_token_id=tok_mod.EOT_ID,
    )
    conf._attn_implementation = "sdpa"
    return Qwen3NextForCausalLM(conf)


def save_shards(model: torch.nn.Module, work: Path) -> list[str]:
    from safetensors.torch import save_file

    sd = {
        k: v.detach().to(torch.bfloat16).contiguous().cpu()
        for k, v in model.state_dict().items()
        if k != "lm_head.weight"  # tied to the embedding
    }
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in sd.items():
        nbytes = v.numel() * 2
        if size + nbytes > SHARD_BYTES and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += nbytes
    names = []
    for i, shard in enumerate(shards):
        name = f"hybrid-{i:05d}.safetensors"
        save_file(shard, str(work / name), metadata={"format": "pt"})
        names.append(name)
    return names


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--work", required=True, type=Path)
    ap.add_argument("--tokenizer", required=True, type=Path, help="folder with tokenizer.json")
    ap.add_argument("--deadline", type=float, default=480.0)
    ap.add_argument("--reserve", type=float, default=30.0)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--max-steps", type=int, default=0)
    ap.add_argument("--eval-tokens", type=int, default=0)
    ap.add_argument("--max-site-bytes", type=int, default=260_000_000)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    work: Path = args.work
    work.mkdir(parents=True, exist_ok=True)
    shutil.copy(args.tokenizer / "tokenizer.json", work / "tokenizer.json")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tk, c, stats = base.prepare(work, train_tokenizer=False, max_site_bytes=args.max_site_bytes)
    stream, tstats = base.tokenize_corpus(tk, c)
    held = base.heldout_stream(tk, c)
    if args.eval_tokens:
        held = held[: args.eval_tokens]
    base.log(f"tokens: train {len(stream):,} ({tstats}), heldout {len(held):,}")
    torch.manual_seed(0)
    vocab = tk.get_vocab_size()
    model = build_model(vocab).to(dev)
    base.log(f"hybrid params {base.n_params(model):,}")
    opt = torch.optim.AdamW(
        model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
        fused=dev.type == "cuda",
    )
    batches = base.Batches(stream, dev, seed=3)
    tokens_per_step = args.batch * args.seq
    budget = args.deadline - (time.time() - base.T0) - args.reserve
    base.log(f"training budget {budget:.0f}s, {tokens_per_step} tokens/step")
    t_start, step, seen = time.time(), 0, 0
    while True:
        progress = (time.time() - t_start) / budget
        if progress >= 1.0 or (args.max_steps and step >= args.max_steps):
            break
        seq = args.seq if progress < 0.7 else min(base.CONTEXT, max(args.seq, 2 * args.seq))
        bsz = max(1, tokens_per_step // seq)
        for g in opt.param_groups:
            g["lr"] = base.lr_at(step, progress, args.lr, args.warmup)
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
        if step % 50 == 0 or step == 1:
            el = time.time() - t_start
            base.log(f"step {step} p={progress:.3f} seq={seq} loss={loss.item():.4f}"
                     f" tok/s={seen / el:,.0f}")
    train_s = time.time() - t_start
    ev = base.eval_heldout(model, held, dev)
    base.log(f"hybrid done: {step} steps, {seen:,} tokens, {train_s:.0f}s; heldout {ev}")
    shards = save_shards(model, work)
    # The reference sees the weights exactly as shipped (bfloat16), computed in float32.
    model = model.to(torch.bfloat16).float().eval()
    ref_ids = torch.from_numpy(held[:REFERENCE_TOKENS].astype(np.int64)).to(dev)[None]
    with torch.no_grad():
        ref_logits = model(ref_ids).logits[0].float().cpu().numpy()
    np.savez_compressed(work / "hybrid_reference.npz", ids=held[:REFERENCE_TOKENS],
                        logits=ref_logits)
    import transformers

    manifest = {
        "config": mlx_config(vocab),
        "shards": shards,
        "corpus": {k: v for k, v in stats.items() if k != "site_packages_top"},
        "tokens": {"train": len(stream), "heldout": len(held), **tstats},
        "hybrid": {
            "params": base.n_params(model),
            "steps": step,
            "tokens_seen": seen,
            "train_seconds": round(train_s, 1),
            "peak_lr": args.lr,
            "tokens_per_step": tokens_per_step,
            "heldout_bf16_torch": ev,
        },
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        },
    }
    (work / "hybrid_manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    base.log("hybrid written")


if __name__ == "__main__":
    main()
