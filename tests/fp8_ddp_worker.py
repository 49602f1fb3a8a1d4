"""A 2-process CPU (gloo) fp8 training run for tests/test_fp8.py; each rank writes ``OUT/rank<r>.json``: the fp8
layers, the dtypes of the weights during training, and a SHA-256 of its fp32 masters after each step.

usage: python fp8_ddp_worker.py OUT
"""

import hashlib
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning as L
import torch
from models import TinyMLP, quiet_trainer, regression_data

from lightning_mpt import MPTPrecision
from lightning_mpt.callbacks import Float8Monitor


class Record(L.Callback):
    def __init__(self) -> None:
        self.hashes: list[str] = []
        self.dtypes: dict[str, str] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        plugin = trainer.precision_plugin
        digest = hashlib.sha256()
        for name, _, master in plugin.named_masters():
            digest.update(name.encode() + master.detach().cpu().numpy().tobytes())
        self.hashes.append(digest.hexdigest())
        self.dtypes = {n: str(p.dtype) for n, p in pl_module.named_parameters()}


def main() -> None:
    out = Path(sys.argv[1])
    torch.manual_seed(0)
    model = TinyMLP(d_in=16, hidden=32, d_out=16)
    record = Record()
    trainer = quiet_trainer(
        strategy="ddp",
        devices=2,
        max_steps=3,
        plugins=[MPTPrecision("bf16", fp8=True, fp8_emulate=True)],
        callbacks=[record, Float8Monitor(every_n_steps=1)],
        logger=L.pytorch.loggers.TensorBoardLogger(out / "tb", name="", version="run"),
    )
    data = regression_data(d_in=16, d_out=16, seed=trainer.global_rank)  # each rank its own batches
    trainer.fit(model, data)
    layers = [n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"]
    rank = trainer.global_rank
    result = {"layers": layers, "dtypes": record.dtypes, "hashes": record.hashes}
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    (out / f"done-rank{rank}").write_text("ok")


if __name__ == "__main__":
    main()
