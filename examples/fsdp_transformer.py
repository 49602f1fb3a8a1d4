"""A small GPT-style transformer trained with FSDP2 (Lightning's ``ModelParallelStrategy``) and MPTPrecision.

    python examples/fsdp_transformer.py               # 2 CPU processes (gloo), fp16, dynamic scale, ~35 s
    python examples/fsdp_transformer.py --fast        # a few seconds (what the tests run)
    tensorboard --logdir runs                         # runs/fsdp_transformer: train_loss and the loss-scale charts

The model is sharded in ``configure_model`` as Lightning documents FSDP2, with one extra keyword, the plugin's
policy: ``fully_shard(block, mesh=mesh, mp_policy=self.trainer.precision_plugin.mp_policy)``, on every transformer
block and then on the whole model. Each LayerNorm is sharded on its own first, with torch's default (fp32) policy,
so norm weights compute in fp32 (``--half-norms`` leaves them in their block, all-gathered in the half format).

What happens per rank: FSDP keeps each parameter as an fp32 shard, which is the master weight the optimizer steps
(AdamW's state is sharded and fp32 too). Before a block runs, FSDP all-gathers its parameters in fp16 (the compute
copy, freed after use); the gradients are reduce-scattered in fp16 (``--reduce-fp32`` for fp32) and kept as fp32
shards. The plugin scales the loss, unscales the gradient shards with torch's fused kernel, agrees with the other
ranks on whether any gradient was inf/NaN in one all-reduce, and steps or skips on every rank alike.
``LossScaleMonitor`` logs the scale, the skipped steps and the parameters that overflowed.

The task: sequences from a fixed random Markov chain over ``--vocab`` tokens (each token has a few likely
successors); the model learns the transitions, and the loss falls from log(vocab) towards the chain's entropy.

On GPUs (one process per GPU; on several nodes launch with torchrun or SLURM, see docs/distributed.md):

    python examples/fsdp_transformer.py --accelerator gpu --devices 8 --dim 1024 --depth 24 --heads 16 \\
        --seq-len 1024 --batch-size 8 --steps 2000
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Optional

import lightning as L
import torch
from example_utils import example_parser, fit, make_trainer, parse_args, print_summary
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

from lightning_mpt import MPTPrecision
from lightning_mpt.callbacks import LossScaleMonitor
from lightning_mpt.core.masters import is_fully_sharded


class Block(nn.Module):
    """A pre-LN transformer block: causal self-attention and a GELU feed-forward, each with a residual."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device, dtype=torch.bool)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """Token and position embeddings, ``depth`` blocks, a final LayerNorm and a linear head."""

    def __init__(self, vocab: int, seq_len: int, dim: int, depth: int, heads: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits of shape ``(batch * length, vocab)`` (flat: a fresh tensor, not a view, leaves the FSDP root)."""
        x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).flatten(0, 1))


class LitGPT(L.LightningModule):
    """Next-token prediction with :class:`GPT`, sharded with FSDP2 in :meth:`configure_model`.

    Example::

        model = LitGPT(vocab=16, seq_len=8, dim=16, depth=1, heads=2)
        assert model.model(torch.zeros(2, 8, dtype=torch.long)).shape == (2 * 8, 16)
    """

    def __init__(
        self,
        vocab: int = 32,
        seq_len: int = 32,
        dim: int = 64,
        depth: int = 2,
        heads: int = 4,
        lr: float = 3e-3,
        half_norms: bool = False,
        reduce_fp32: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = GPT(vocab, seq_len, dim, depth, heads)

    def configure_model(self) -> None:
        if self.device_mesh is None or is_fully_sharded(self.model):  # one device, or sharded by an earlier stage
            return
        policy = self.trainer.precision_plugin.mp_policy  # param_dtype and reduce_dtype: the plugin's half format
        if self.hparams.reduce_fp32:
            policy = dataclasses.replace(policy, reduce_dtype=torch.float32)
        mesh = self.device_mesh["data_parallel"]
        if not self.hparams.half_norms:
            for module in self.model.modules():
                if isinstance(module, nn.LayerNorm):
                    fully_shard(module, mesh=mesh)  # torch's default policy: all-gathered and computed in fp32
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(self.model, mesh=mesh, mp_policy=policy)

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        logits = self.model(ids[:, :-1])
        loss = nn.functional.cross_entropy(logits.float(), ids[:, 1:].flatten())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)


def markov_data(n: int, vocab: int, seq_len: int, seed: int = 0) -> TensorDataset:
    """``n`` sequences of ``seq_len + 1`` tokens from a random Markov chain in which each token has 3 likely
    successors (90% of the mass) and a uniform tail.

    Example::

        (ids,) = markov_data(4, vocab=16, seq_len=8)[:]
        assert ids.shape == (4, 9) and int(ids.max()) < 16
    """
    g = torch.Generator().manual_seed(seed)
    probs = torch.full((vocab, vocab), 0.1 / vocab)
    for token in range(vocab):
        probs[token, torch.randperm(vocab, generator=g)[:3]] += 0.3
    ids = torch.empty(n, seq_len + 1, dtype=torch.long)
    ids[:, 0] = torch.randint(0, vocab, (n,), generator=g)
    for t in range(seq_len):
        ids[:, t + 1] = torch.multinomial(probs[ids[:, t]], 1, generator=g).squeeze(1)
    return TensorDataset(ids)


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    """Train and return a summary (on every rank; rank 0 prints it and writes ``--summary``)."""
    p = example_parser(__doc__, steps=300)
    p.add_argument("--devices", type=int, default=2, help="processes per node (CPU) or GPUs per node")
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--vocab", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=16, help="per process")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--half-norms", action="store_true", help="all-gather LayerNorms in the half format")
    p.add_argument("--reduce-fp32", action="store_true", help="reduce-scatter gradients in fp32")
    p.add_argument("--summary", default=None, help="write the summary as JSON to this file (rank 0)")
    args = parse_args(p, argv, fast={"steps": 30, "dim": 32, "depth": 2, "heads": 2, "seq_len": 16, "batch_size": 8})

    L.seed_everything(0, verbose=False)  # the same initial weights on every rank, before sharding
    world = args.devices * args.num_nodes
    data = markov_data(args.batch_size * world * args.steps, args.vocab, args.seq_len)
    plugin = MPTPrecision(args.precision)
    trainer = make_trainer(
        args,
        "fsdp_transformer",
        plugins=[plugin],
        callbacks=[LossScaleMonitor()],
        strategy=ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
        devices=args.devices,
        num_nodes=args.num_nodes,
    )
    model = LitGPT(
        args.vocab, args.seq_len, args.dim, args.depth, args.heads, args.lr, args.half_norms, args.reduce_fp32
    )
    first_scale = plugin.loss_scale
    summary = fit(trainer, model, DataLoader(data, batch_size=args.batch_size))
    master = plugin.main_params(trainer.optimizers[0])[0]
    summary.update(
        first_loss_scale=first_scale,
        strategy=type(trainer.strategy).__name__,
        world_size=world,
        masters=f"{type(master).__name__} {master.dtype}",
    )
    if trainer.global_rank == 0:
        print_summary("fsdp_transformer", summary)
        if args.summary:
            with open(f"{args.summary}.tmp", "w") as f:
                json.dump(summary, f)
            os.replace(f"{args.summary}.tmp", args.summary)
    return summary


if __name__ == "__main__":
    main()
