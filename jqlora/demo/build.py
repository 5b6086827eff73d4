"""Build the demo's base model: a small Llama pretrained in PyTorch on the copy task, then
quantized by transformers + bitsandbytes into a standard HF checkpoint (what `*-bnb-4bit`
checkpoints on the Hub are). Everything runs on CPU, offline; nothing is downloaded."""
from __future__ import annotations

import csv
import sys
import time
from pathlib import Path

import numpy as np

import jqlora.demo.task as task


def llama_config(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=task.MODEL_VOCAB_SIZE, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=64, tie_word_embeddings=False, rms_norm_eps=1e-6,
        bos_token_id=task.BOS, eos_token_id=task.EOS, pad_token_id=task.PAD)


def pretrain_copy(out_dir, *, hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2, steps=400,
                  batch=64, lr=3e-3, seed=0, seq_len=24, progress=None) -> dict:
    """Train a fresh LlamaForCausalLM (fp32, PyTorch, CPU) on the copy task and save it (plus the
    tokenizer) to `out_dir`. Returns {"path", "final_loss", "loss_csv", "seconds", "params"}."""
    import torch

    t0 = time.perf_counter()
    out_dir = Path(out_dir)
    threads = torch.get_num_threads()
    # One thread: for a model this small, intra-op threading gains little on an idle machine and
    # loses a lot on a busy one (measured: 0.04-0.06 s/step single-threaded vs 0.04-0.18 s with 2).
    torch.set_num_threads(1)
    try:
        return _pretrain(out_dir, hidden, intermediate, layers, heads, kv_heads, steps, batch, lr, seed, seq_len,
                         progress, t0)
    finally:
        torch.set_num_threads(threads)


def _pretrain(out_dir, hidden, intermediate, layers, heads, kv_heads, steps, batch, lr, seed, seq_len, progress, t0):
    import torch
    from tqdm import tqdm
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config(hidden, intermediate, layers, heads, kv_heads)).float()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    warm = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * min(1.0, s / max(1, steps))))))
    rng = np.random.default_rng(np.random.SeedSequence([seed, 99]))
    losses = []
    bar = tqdm(range(steps), desc="pretrain (torch, copy task)", disable=(not sys.stderr.isatty()) if progress is None
               else not progress, dynamic_ncols=True, file=sys.stderr)
    for step in bar:
        ids, labels = task.copy_batch(rng, batch, seq_len)
        loss = model(input_ids=torch.from_numpy(ids), labels=torch.from_numpy(labels)).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % 10 == 0:
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
    bar.close()
    model.eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    task.save_tokenizer(out_dir)
    csv_path = out_dir / "pretrain_loss.csv"
    with open(csv_path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "loss"])
        w.writerows((i + 1, repr(l)) for i, l in enumerate(losses))
    tail = float(np.mean(losses[-10:])) if losses else float("nan")
    return dict(path=str(out_dir), final_loss=tail, loss_csv=str(csv_path), seconds=time.perf_counter() - t0,
                params=int(sum(p.numel() for p in model.parameters())))


def quantize_with_bnb(dense_dir, out_dir, quant_type: str = "nf4", double_quant: bool = True) -> Path:
    """from_pretrained(dense_dir, quantization_config=BitsAndBytesConfig(4-bit ...), device_map="cpu")
    then save_pretrained(out_dir): bitsandbytes quantizes every linear layer except lm_head."""
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from interop.atomic_io import atomic_directory

    out_dir = Path(out_dir)
    cfg = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type,
                             bnb_4bit_use_double_quant=double_quant, bnb_4bit_compute_dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(str(dense_dir), quantization_config=cfg, device_map="cpu",
                                                 dtype=torch.float32)
    # written beside out_dir and renamed into place; the folder gets the umask's mode, as every
    # export's does (a TemporaryDirectory's would be 0700)
    with atomic_directory(out_dir, overwrite=True) as tmp:
        model.save_pretrained(tmp)
        task.save_tokenizer(tmp)
    return out_dir
