"""A small BERT-like encoder fine-tuned with MPTPrecision on a synthetic sentiment task, with torchmetrics accuracy.

    python examples/bert_finetune.py               # fp16, about 9 s on 2 quiet CPU cores
    python examples/bert_finetune.py --fast        # a few seconds (what the tests run)
    tensorboard --logdir runs                      # runs/bert_finetune: train_loss, train_acc, val_acc, lr, loss_scale

The task: each sequence is ``[CLS]`` followed by filler words, a few "positive" and a few "negative" words at
random places, and padding. The label says whether positive words outnumber negative ones, so the classifier
has to pool over the whole sequence through self-attention; a bag of the first tokens cannot solve it.

The model is BERT's layout at toy size: token + position embeddings, an embedding LayerNorm, post-LN
self-attention layers with GELU feed-forwards, a tanh pooler on the ``[CLS]`` token and a linear classifier.
Training follows BERT's fine-tuning recipe: AdamW, linear warm-up then linear decay, no weight decay on biases
and LayerNorm parameters.

What it shows: embeddings, attention and feed-forward weights in fp16, every LayerNorm in fp32, softmax and the
loss computed in fp32 by autocast, AdamW stepping fp32 masters under an LR schedule. Validation accuracy goes
from chance (0.5) to above 0.95 in the default 300 steps; the dynamic scale stays at 2^16 with no skipped step.

On a GPU, scale it up (BERT-base is dim 768, 12 layers, 12 heads):

    python examples/bert_finetune.py --accelerator gpu --dim 768 --layers 12 --heads 12 --seq-len 128 \
        --batch-size 64 --steps 3000
"""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import torch
from example_utils import (
    Classifier,
    decay_groups,
    diagnostics,
    example_parser,
    fit,
    make_trainer,
    parse_args,
    print_summary,
)
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mpt import MPTPrecision

PAD, CLS, POSITIVE, NEGATIVE = 0, 1, range(2, 6), range(6, 10)  # token ids; fillers are the ids from 10 up


def sentiment_data(n: int, vocab: int, seq_len: int, seed: int) -> TensorDataset:
    """``n`` sequences of length ``seq_len`` and their labels (1: more positive than negative words).

    Example::

        ids, labels = sentiment_data(4, vocab=32, seq_len=16, seed=0)[:]
        assert ids.shape == (4, 16) and bool((ids[:, 0] == CLS).all())
    """
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 2, (n,), generator=g)
    ids = torch.full((n, seq_len), PAD)
    for i in range(n):
        length = int(torch.randint(seq_len // 2, seq_len, (), generator=g))
        major = int(torch.randint(2, 5, (), generator=g))
        minor = int(torch.randint(0, major, (), generator=g))  # strictly fewer: no ties
        n_pos, n_neg = (major, minor) if labels[i] else (minor, major)
        words = torch.randint(NEGATIVE.stop, vocab, (length - 1,), generator=g)
        slots = torch.randperm(length - 1, generator=g)[: n_pos + n_neg]
        words[slots[:n_pos]] = torch.randint(POSITIVE.start, POSITIVE.stop, (n_pos,), generator=g)
        words[slots[n_pos:]] = torch.randint(NEGATIVE.start, NEGATIVE.stop, (n_neg,), generator=g)
        ids[i, 0] = CLS
        ids[i, 1:length] = words
    return TensorDataset(ids, labels)


class TinyBert(Classifier):
    """A BERT-style encoder with a ``[CLS]`` classification head.

    Example::

        model = TinyBert(vocab=32, seq_len=16, dim=32, layers=1, heads=2)
        assert model(torch.ones(2, 16, dtype=torch.long)).shape == (2, 2)
    """

    def __init__(
        self,
        vocab: int = 64,
        seq_len: int = 32,
        dim: int = 64,
        layers: int = 2,
        heads: int = 4,
        classes: int = 2,
        lr: float = 1e-3,
        warmup: float = 0.1,
        weight_decay: float = 0.01,
    ) -> None:
        super().__init__(classes)
        self.save_hyperparameters()
        self.tokens = nn.Embedding(vocab, dim, padding_idx=PAD)
        self.positions = nn.Embedding(seq_len, dim)
        self.embed_norm = nn.LayerNorm(dim)
        self.dropout = nn.Dropout(0.1)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.1, activation="gelu", batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.pooler = nn.Sequential(nn.Linear(dim, dim), nn.Tanh())
        self.classifier = nn.Linear(dim, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tokens(ids) + self.positions.weight[: ids.shape[1]]
        h = self.encoder(self.dropout(self.embed_norm(h)), src_key_padding_mask=ids == PAD)
        return self.classifier(self.pooler(h[:, 0]))  # [CLS] pooling

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(decay_groups(self, self.hparams.weight_decay), lr=self.hparams.lr)
        total = self.trainer.max_steps
        warmup = max(1, int(self.hparams.warmup * total))
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda step: min((step + 1) / warmup, max(0.0, (total - step) / (total - warmup)))
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    """Fine-tune and return a summary: losses at the start and end, validation accuracy, skipped steps."""
    p = example_parser(__doc__, steps=300)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    args = parse_args(p, argv, fast={"steps": 100, "dim": 32, "layers": 1, "heads": 2, "seq_len": 16, "vocab": 32})

    L.seed_everything(0, verbose=False)
    train = DataLoader(
        sentiment_data(args.batch_size * args.steps, args.vocab, args.seq_len, seed=0),
        batch_size=args.batch_size,
        shuffle=True,
    )
    val = DataLoader(sentiment_data(512, args.vocab, args.seq_len, seed=1), batch_size=256)
    plugin = MPTPrecision(args.precision)
    trainer = make_trainer(
        args,
        "bert_finetune",
        plugins=[plugin],
        val_check_interval=args.steps,
        callbacks=[*diagnostics(args.steps), L.pytorch.callbacks.LearningRateMonitor("step")],
    )
    model = TinyBert(args.vocab, args.seq_len, args.dim, args.layers, args.heads, lr=args.lr)
    summary = fit(trainer, model, train, val)
    print_summary("bert_finetune", summary)
    return summary


if __name__ == "__main__":
    main()
