"""``MPTPrecision`` for Lightning Fabric: a half-precision model, fp32 master weights owned by the optimizer, a dynamic
loss scaler, and the skip decision taken before the optimizer runs.

The sibling of the Trainer plugin (:class:`lightning_mpt.MPTPrecision`): the same arguments, the same public
attributes, the same :class:`~lightning_mpt.core.engine.MixedPrecisionEngine` underneath. What each Fabric call does:

- ``fabric.setup(model, optimizer)`` casts the model to fp16/bf16 in place (norm layers stay fp32); the fp32 tensors
  it had become the masters. The optimizer object stays the same: at each step it updates the masters, and its state
  is fp32.
- ``model(x)`` runs under autocast; floating outputs come back in fp32, so a loss computed outside the model is fp32.
  So do methods marked with ``model.mark_forward_method(name)``, on one device as under DDP.
- ``fabric.backward(loss)`` multiplies the loss by the scale before backpropagating.
- ``fabric.clip_gradients(model, optimizer, ...)`` first unscales the gradients into fp32 and decides the step (one
  host sync, all-reduced across processes), then clips the fp32 gradients the optimizer will step.
- ``optimizer.step()`` steps the masters and writes them into the half weights, or, when a gradient was non-finite on
  any process, skips: nothing changes, the scale backs off, the gradients are zeroed.
- ``fabric.save``/``fabric.load``: the model's ``state_dict`` holds the fp32 masters; put the plugin in the state to
  save the scaler and counters. The optimizer's state loads into fp32 exactly: the plugin finds the optimizers that
  hold the model's parameters before their state is loaded.

Under FSDP2 (Fabric's ``ModelParallelStrategy``, ``MPTPrecision(..., sharded=True)``) ``fabric.setup_module`` leaves the
model fp32 and the strategy's ``parallelize_fn`` shards it with ``fully_shard(..., mp_policy=plugin.mp_policy)``: its
fp32 shards are the masters and FSDP computes in the half format (:mod:`lightning_mpt.core.masters.sharded`).
Everything else above holds as it is.

Example:
    ```python
    import lightning as L
    import torch
    from torch import nn
    from lightning_mpt.fabric import MPTPrecision

    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[MPTPrecision("bf16")])
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    for _ in range(3):
        loss = model(torch.randn(32, 8)).pow(2).mean()
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
    plugin = fabric.strategy.precision
    weight = model.module[0].weight
    assert weight.dtype == torch.bfloat16 and plugin.master_of(weight).dtype == torch.float32
    assert len(plugin.history) == 3 and plugin.skipped_steps == 0
    plugin.restore()  # done: the module is fp32 again and holds the masters
    assert model.module[0].weight.dtype == torch.float32
    ```
"""

from typing import TYPE_CHECKING

from lightning_mpt._lazy import lazy_exports

if TYPE_CHECKING:
    from lightning_mpt.core.steps import NonFiniteGradientError, StepRecord
    from lightning_mpt.fabric.logger import MixedPrecisionLogger
    from lightning_mpt.fabric.precision import MPTPrecision

__all__ = ["MPTPrecision", "MixedPrecisionLogger", "NonFiniteGradientError", "StepRecord"]
# imported on first use: the logger brings TensorBoard and torchmetrics
__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "MPTPrecision": "lightning_mpt.fabric.precision",
        "MixedPrecisionLogger": "lightning_mpt.fabric.logger",
        "NonFiniteGradientError": "lightning_mpt.core.steps",
        "StepRecord": "lightning_mpt.core.steps",
    },
)
