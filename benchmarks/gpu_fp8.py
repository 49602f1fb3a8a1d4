"""GPT-2 small (124M, hand-written) on one CUDA GPU: Lightning's "bf16-mixed", MPTPrecision("bf16") and
MPTPrecision("bf16", fp8="tensorwise"): tokens per second and peak memory, and their ratios (``make gpu-check``).

    python benchmarks/gpu_fp8.py [--steps 30] [--batch 8] [--seq 1024] [--out build/gpu-fp8.md]

fp8 needs a GPU of compute capability >= 8.9 (the fp8 row is left out below it, with the reason). Without CUDA the
script says so and exits 0.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn
from torch.nn import functional as F


class GPT2Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


def gpt2_small(vocab: int = 50304, seq: int = 1024, d: int = 768, layers: int = 12, heads: int = 12) -> Any:
    """GPT-2 small as a LightningModule (vocabulary padded to 50304, a multiple of 16 and 64)."""
    import lightning as L

    class GPT2(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
            self.blocks = nn.ModuleList([GPT2Block(d, heads) for _ in range(layers)])
            self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln(x))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return F.cross_entropy(self(batch[:, :-1]).float().flatten(0, 1), batch[:, 1:].flatten())

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=3e-4, fused=True)

    return GPT2()


class Timer:
    """Times the steps after ``warmup`` (CUDA-synchronised at both ends)."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.start, self.steps = warmup, 0.0, 0

    def __call__(self, step: int) -> None:
        if step == self.warmup:
            torch.cuda.synchronize()
            self.start = time.perf_counter()
        self.steps = step


def run(precision: Any, args: argparse.Namespace) -> dict[str, float]:
    import lightning as L

    torch.manual_seed(0)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = gpt2_small(seq=args.seq)
    data = torch.randint(0, 50304, (args.batch * (args.steps + 1), args.seq + 1))
    timer = Timer(args.warmup)

    class Tick(L.Callback):
        def on_train_batch_start(self, trainer: Any, *a: Any) -> None:
            timer(trainer.global_step)

    kwargs: dict[str, Any] = {"plugins": [precision]} if not isinstance(precision, str) else {"precision": precision}
    trainer = L.Trainer(
        accelerator="gpu", devices=1, max_steps=args.steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[Tick()], **kwargs,
    )  # fmt: skip
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=args.batch))
    torch.cuda.synchronize()
    seconds = time.perf_counter() - timer.start
    steps = args.steps - args.warmup
    return {
        "tokens_per_s": steps * args.batch * args.seq / seconds,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
    }


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--out", default="build/gpu-fp8.md")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_fp8: no CUDA GPU on this machine; nothing to measure (run `make gpu-check` on a CUDA machine).")
        return 0
    from lightning_mpt import MPTPrecision

    configs: dict[str, Any] = {"bf16-mixed": "bf16-mixed", 'MPTPrecision("bf16")': MPTPrecision("bf16")}
    capability = torch.cuda.get_device_capability()
    if capability >= (8, 9):
        configs['MPTPrecision("bf16", fp8="tensorwise")'] = MPTPrecision("bf16", fp8="tensorwise")
    else:
        print(f"gpu_fp8: compute capability {capability[0]}.{capability[1]} < 8.9: no fp8 Tensor Cores, fp8 left out")
    results = {name: run(precision, args) for name, precision in configs.items()}
    base = results["bf16-mixed"]
    lines = [
        f"GPT-2 small, batch {args.batch} x {args.seq} tokens, {torch.cuda.get_device_name()}",
        "",
        "| precision | tokens/s | x bf16-mixed | peak GiB | x bf16-mixed |",
        "|---|---|---|---|---|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['tokens_per_s']:.0f} | {r['tokens_per_s'] / base['tokens_per_s']:.2f} | "
            f"{r['peak_gib']:.2f} | {r['peak_gib'] / base['peak_gib']:.2f} |"
        )
    text = "\n".join(lines)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
