"""fp8 compute with torchao: a small GPT-style transformer trained with MPTPrecision("bf16", fp8=...).

    python examples/fp8_transformer.py                 # a few seconds on 2 CPU cores (fp8 emulated on a CPU)
    python examples/fp8_transformer.py --fast          # 10 steps (what the tests run)
    lightning-mpt report runs/fp8                      # the fp8 casts by layer and role, and the advice
    tensorboard --logdir runs/fp8                      # mpt/fp8/... in the "Mixed precision" dashboard

On a GPU with fp8 Tensor Cores (compute capability >= 8.9) the matmuls run in fp8 for real:
    python examples/fp8_transformer.py --accelerator gpu --d-model 512 --layers 4 --steps 500

`--outlier` multiplies one channel of the first MLP's input by 1e4 (an activation outlier, as in large language
models): torchao's tensorwise scale then follows the outlier and the cast flushes most other values of that input to
zero, which the report names, with the `fp8_filter` that keeps that layer in bf16.
"""

from __future__ import annotations

import argparse
from typing import Any, Optional

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_mpt import MPTPrecision
from lightning_mpt.callbacks import Float8Monitor, LossScaleMonitor


class Block(nn.Module):
    """Pre-norm attention and MLP, with Linear layers torchao can convert (no nn.MultiheadAttention)."""

    def __init__(self, d_model: int, heads: int, outlier: float = 1.0) -> None:
        super().__init__()
        self.heads, self.outlier = heads, outlier
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        h = self.norm2(x)
        if self.outlier != 1.0:  # one channel far above the others
            h = torch.cat([h[..., :1] * self.outlier, h[..., 1:]], dim=-1)
        return x + self.fc2(F.gelu(self.fc1(h)))


class TinyGPT(L.LightningModule):
    """Token embedding, ``layers`` blocks, a final norm and an output head."""

    def __init__(
        self,
        vocab: int = 32,
        d_model: int = 32,
        heads: int = 2,
        layers: int = 1,
        lr: float = 1e-2,
        outlier: float = 1.0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab, d_model)
        self.blocks = nn.ModuleList([Block(d_model, heads, outlier if i == 0 else 1.0) for i in range(layers)])
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        self.losses: list[float] = []

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        logits = self(tokens)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        self.losses.append(loss.item())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def copy_task(n: int = 96, seq: int = 16, vocab: int = 32, batch_size: int = 16, seed: int = 0) -> DataLoader:
    """Predict the previous token: learnable in a few dozen steps."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (n, seq), generator=g)
    return DataLoader(TensorDataset(x, torch.roll(x, 1, dims=1)), batch_size=batch_size, shuffle=False)


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--d-model", type=int, default=32)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--recipe", default="tensorwise", choices=["tensorwise", "rowwise", "rowwise_with_gw_hp"])
    parser.add_argument("--outlier", type=float, default=1e4, help="the first MLP input's outlier (1: none)")
    parser.add_argument("--logdir", default="runs/fp8")
    parser.add_argument("--every", type=int, default=5, help="optimizer steps between fp8 statistics")
    parser.add_argument("--fast", action="store_true", help="10 steps (what the tests run)")
    args = parser.parse_args(argv)
    if args.fast:  # fewer steps by default; a --steps given explicitly still wins
        parser.set_defaults(steps=10)
        args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = TinyGPT(d_model=args.d_model, layers=args.layers, outlier=args.outlier)
    emulate = args.accelerator == "cpu" or not torch.cuda.is_available()  # no silent emulation: asked for here
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=1,
        max_steps=args.steps,
        plugins=[MPTPrecision("bf16", fp8=args.recipe, fp8_emulate=emulate)],
        callbacks=[Float8Monitor(every_n_steps=args.every), LossScaleMonitor()],
        logger=L.pytorch.loggers.TensorBoardLogger(args.logdir, name="", version=args.recipe),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=args.every,
    )
    trainer.fit(model, copy_task(vocab=model.hparams.vocab))
    print(f"fp8 ({args.recipe}{', emulated' if emulate else ''}): loss {model.losses[0]:.3f} -> {model.losses[-1]:.3f}")
    print(f"logs in {args.logdir}; read them with: lightning-mpt report {args.logdir}")
    return {"losses": model.losses, "logdir": f"{args.logdir}/{args.recipe}"}


if __name__ == "__main__":
    main()
