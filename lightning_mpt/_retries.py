"""What a discarded try of ``MPTPrecision(overflow_retries=N)`` logged and counted, taken back before the batch runs
again, so that the epoch counts each batch once, with its last try's values.

A retry runs Lightning's closure again: ``training_step``, its ``self.log`` calls and the updates of the module's
torchmetrics objects run once per try. Before the first try of a batch :class:`TryState` copies the loop's logged
results (each logged name's running reduction) and the state of every torchmetrics ``Metric`` of the LightningModule;
before each retry it puts them back. Other side effects of a try (BatchNorm's running statistics, dropout's random
draws, callbacks' own counters) stay, as docs/scaler.md says.
"""

from __future__ import annotations

from typing import Any, Optional

from torch import Tensor
from torch.nn import Module
from torchmetrics import Metric

from lightning_mpt import _compat
from lightning_mpt.diagnostics.replay import metric_state

__all__ = ["TryState"]


class TryState:
    """The logged results of the running loop and the module's torchmetrics states, as they were before a try.

    Args:
        module: the LightningModule whose ``training_step`` is about to run.

    Example:
        ```python
        import torch
        from torchmetrics import SumMetric

        module = torch.nn.Module()
        module.seen = SumMetric()
        before = TryState(module)  # no Trainer attached: only the metrics are kept
        module.seen.update(1.0)  # a try that is discarded
        before.restore()
        assert float(module.seen.compute()) == 0.0
        ```
    """

    def __init__(self, module: Module) -> None:
        trainer = _compat.attached_trainer(module)
        self._results: Optional[dict[str, Any]] = _compat.logged_results(trainer) if trainer is not None else None
        # a _ResultMetric's tensors are replaced, never changed in place, by each update: references are copies
        self._logged = {key: (result, _logged_state(result)) for key, result in (self._results or {}).items()}
        # a user's metric may add in place (``self.total += x``): its tensors are cloned
        self._metrics = [(m, metric_state(m)) for m in module.modules() if isinstance(m, Metric)]

    def restore(self) -> None:
        """Put back what the try since :meth:`__init__` logged and counted (the copies stay valid for a next try)."""
        if self._results is not None:
            for key in [k for k in self._results if k not in self._logged]:  # first logged by the discarded try
                del self._results[key]
            for key, (result, state) in self._logged.items():
                self._results[key] = result
                for name, value in state.items():
                    setattr(result, name, value)
        for metric, saved in self._metrics:
            for name, value in saved.items():
                setattr(metric, name, _copy(value))


def _logged_state(result: Metric) -> dict[str, Any]:
    """The attributes of a ``_ResultMetric`` that logging changes: its reduction's states (``value`` and
    ``cumulated_batch_size``), the logged object when it is a metric (``value``), the caches and ``has_reset``."""
    state: dict[str, Any] = dict(result.metric_state)
    state.update(_compat.metric_private_state(result))
    state["value"] = result.__dict__.get("value")
    state["has_reset"] = result.__dict__.get("has_reset", False)
    return state


def _copy(value: Any) -> Any:
    """A copy that the next try may change in place without changing the saved one."""
    if isinstance(value, Tensor):
        return value.clone()
    return list(value) if isinstance(value, list) else value
