"""The package's shape: lines per module and per layer, the largest modules and classes, and the calls one fp16
optimizer step makes into the package.

    python scripts/layout_stats.py            # sizes, then the calls of one step
    python scripts/layout_stats.py --detail   # and the calls of each function

The step is one automatic optimization step of a small MLP under ``MPTPrecision("fp16")`` on the CPU, after two warm-up
steps; ``sys.setprofile`` counts the calls of Python functions defined in ``lightning_mpt`` (functions made by
dataclasses and C functions are not ours and are not counted).
"""

from __future__ import annotations

import ast
import sys
from collections import Counter
from pathlib import Path
from typing import Any

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_mpt"


def sizes() -> None:
    modules = {p.relative_to(PACKAGE).as_posix(): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    layers: Counter[str] = Counter()
    for name, n in modules.items():
        layers[name.split("/")[0] if "/" in name else "(top level)"] += n
    classes = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                classes.append((node.end_lineno - node.lineno + 1, f"{path.relative_to(PACKAGE)}:{node.name}"))
    print(f"lightning_mpt: {sum(modules.values())} lines in {len(modules)} modules")
    for layer, n in sorted(layers.items(), key=lambda kv: -kv[1]):
        print(f"  {layer:<14} {n:>6}")
    print("largest modules:", ", ".join(f"{m} {n}" for m, n in sorted(modules.items(), key=lambda kv: -kv[1])[:5]))
    print("largest classes:", ", ".join(f"{c} {n}" for n, c in sorted(classes, reverse=True)[:5]))


def step_calls(detail: bool = False) -> None:
    import warnings

    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_mpt import MPTPrecision

    warnings.filterwarnings("ignore")
    calls: Counter[tuple[str, str]] = Counter()
    root = str(PACKAGE)

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(root):
            module = Path(frame.f_code.co_filename).relative_to(PACKAGE).as_posix()
            calls[(module, frame.f_code.co_qualname)] += 1

    class Counted(L.Callback):
        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == 2:
                sys.setprofile(profile)

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            sys.setprofile(None)

    class MLP(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 4))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.net(x).float(), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(64, 16), torch.randn(64, 4)), batch_size=16)
    trainer = L.Trainer(
        max_steps=3,
        accelerator="cpu",
        plugins=[MPTPrecision("fp16", scaler=2.0**8)],
        callbacks=[Counted()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(MLP(), data)
    modules = Counter[str]()
    for (module, _), n in calls.items():
        modules[module] += n
    print(f"one fp16 step: {sum(calls.values())} calls of {len(calls)} functions in {len(modules)} modules")
    for module, n in modules.most_common():
        print(f"  {module:<34} {n:>4}")
    if detail:
        for (module, function), n in calls.most_common():
            print(f"  {n:>4}  {module}: {function}")


if __name__ == "__main__":
    sizes()
    print()
    step_calls(detail="--detail" in sys.argv)
