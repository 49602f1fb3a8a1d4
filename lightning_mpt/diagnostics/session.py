"""``DiagnosticSession``: the diagnostics of one run, whichever loop drives them.

A front-end makes one session per run (the Trainer's monitors one per fit, together; Fabric's
``MixedPrecisionLogger`` one) and drives the statistic sets on it at its own call points: a
:class:`~lightning_mpt.diagnostics.loss_scale.ScaleTracker`, an
:class:`~lightning_mpt.diagnostics.underflow.UnderflowStatistics` and a
:class:`~lightning_mpt.diagnostics.histograms.GradientHistograms`. The session holds what they share: the recorder
(the sink, the one-sync read-out, the shards), the table of half parameters, the warnings, and what is written once.

Example:
    ```python
    import tempfile

    import torch
    from lightning.fabric.loggers import TensorBoardLogger
    from torch import nn
    from lightning_mpt.diagnostics.session import DiagnosticSession
    from lightning_mpt.diagnostics.underflow import UnderflowStatistics
    from lightning_mpt.fabric import MPTPrecision

    plugin = MPTPrecision("fp16")
    model = plugin.convert_module(nn.Linear(4, 2))
    session = DiagnosticSession.for_loggers([TensorBoardLogger(tempfile.mkdtemp())], TensorBoardLogger, writes=True)
    session.write_header(plugin, charts=None, monitors=["my loop"], step=0)
    underflow = UnderflowStatistics(every_n_steps=1)
    underflow.set_up(session, model, plugin)
    model(torch.randn(8, 4, dtype=torch.float16)).float().pow(2).mean().backward()
    underflow.after_backward(session.recorder, step=0)   # the stored gradients' fractions, queued
    session.recorder.flush()                             # one host read, then written
    plugin.restore()
    ```
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from typing import Any, Optional

from torch import nn

from lightning_mpt.core.numerics import FloatFormat
from lightning_mpt.diagnostics import tags
from lightning_mpt.diagnostics.params import ParamTable
from lightning_mpt.diagnostics.plugin import describe_precision, half_format
from lightning_mpt.diagnostics.recorder import Recorder
from lightning_mpt.diagnostics.shards import Shards
from lightning_mpt.diagnostics.sink import Sink
from lightning_mpt.diagnostics.statistic import Statistic


class DiagnosticSession:
    """What the diagnostics of one run share: the recorder, the half parameters, the warnings and the header.

    Args:
        sink: where the values go (see :meth:`for_loggers`).
        owner: who writes, for messages (``"diagnostics"`` for a Trainer's monitors, ``"MixedPrecisionLogger"``).
        writes: whether this process writes (global rank 0); warnings are said there only.
        strict: raise rather than warn when a statistic fails (``None``: ``LIGHTNING_MPT_STRICT_DIAGNOSTICS``).
    """

    def __init__(
        self, sink: Sink, owner: str = "diagnostics", writes: bool = True, strict: Optional[bool] = None
    ) -> None:
        self.recorder = Recorder(sink)
        self.owner = owner
        self.writes = writes
        self.strict = strict
        self._said: set[str] = set()
        self._table: Optional[ParamTable] = None

    @classmethod
    def for_loggers(
        cls,
        loggers: Sequence[Any],
        tensorboard_logger: type[Any],
        writes: bool,
        owner: str = "diagnostics",
        strict: Optional[bool] = None,
    ) -> DiagnosticSession:
        """The session of a front-end's Lightning loggers: on the writing process every ``tensorboard_logger``
        (Lightning's ``TensorBoardLogger``, passed in by the front-end) gets everything, else the other loggers get
        the scalars (:meth:`Sink.for_loggers`); the other processes write nothing."""
        return cls(Sink.for_loggers(loggers, tensorboard_logger) if writes else Sink(), owner, writes, strict)

    @property
    def sink(self) -> Sink:
        return self.recorder.sink

    def warn_once(self, message: str, key: Optional[str] = None) -> None:
        """Warn with ``message`` once per session (or once per ``key``), on the writing process only."""
        key = message if key is None else key
        if self.writes and key not in self._said:
            self._said.add(key)
            warnings.warn(message, UserWarning, stacklevel=3)

    def warn_without_logger(self, owner: str, loop: str) -> None:
        """Say that nothing will be recorded when the writing process has nowhere to write."""
        if not self.sink.active:
            self.warn_once(f"{owner}: the {loop} has no logger; nothing will be recorded.")

    def shard(self, module: nn.Module, has_loggers: bool) -> None:
        """Once the model is set up (sharded, under FSDP2): whether its parameters are sharded. Then every process
        measures its shards and the recorder reduces them across processes; every process measures when the run has
        loggers (rank 0 writes). Parameters sharded in a way the diagnostics cannot sum turn them off."""
        stat = Statistic(self.owner, "the set-up for sharded parameters (FSDP2)", self.strict)
        try:
            shards = Shards.of(list(module.parameters()))
        except Exception as error:
            self.recorder.active = False  # local numbers of shards would be wrong numbers: measure nothing
            with stat.guarded():
                raise error
            return
        if shards is not None:
            self.recorder.shards = shards
            self.recorder.active = has_loggers

    def write_header(self, plugin: Any, charts: Optional[Iterable[str]], monitors: list[str], step: int) -> None:
        """Write what is written once per run: the dashboard layout with ``charts`` (all when ``None``; once per
        ``SummaryWriter``) and the ``mpt/data/run`` record naming the precision plugin and the ``monitors``."""
        header = Statistic(self.owner, f"the dashboard layout and the {tags.RUN_RECORD} record", self.strict)
        with header.guarded():
            self.sink.layout(charts)
            self.sink.record(tags.RUN_RECORD, {**describe_precision(plugin), "monitors": monitors}, step)

    def half_parameters(
        self, module: nn.Module, plugin: Any, owner: str, otherwise: str
    ) -> Optional[tuple[FloatFormat, ParamTable]]:
        """The format ``plugin`` computes in and the parameters of ``module`` computed in it (found once per session);
        ``None`` with a warning from ``owner`` when there are none (``otherwise``: what is measured then)."""
        fmt = half_format(plugin)
        if fmt is None:
            self.warn_once(
                f"{owner}: the precision plugin {type(plugin).__name__} does not compute in fp16 or bf16; {otherwise}."
                " Use MPTPrecision('fp16'/'bf16') or precision='16-mixed'/'bf16-mixed'.",
                key=f"{owner}: no half format",  # said once per owner, whichever of its statistics asks first
            )
            return None
        if self._table is None:
            self._table = ParamTable(module, plugin, self.recorder.shards)
        if not len(self._table):
            self.warn_once(f"{owner}: no parameter is computed in {fmt.name}; {otherwise}.", key=f"{owner}: no half")
            return None
        return fmt, self._table

    def release(self) -> None:
        """Drop what is queued and cached (the run is over)."""
        self.recorder.release()
