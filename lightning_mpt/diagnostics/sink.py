"""``Sink``: where the diagnostics write: TensorBoard ``SummaryWriter`` s and/or loggers (:meth:`Sink.for_loggers`
picks them from a list of Lightning loggers).

Example:
    ```python
    import tempfile

    from torch.utils.tensorboard import SummaryWriter
    from lightning_mpt.diagnostics import tags
    from lightning_mpt.diagnostics.sink import Sink

    with SummaryWriter(tempfile.mkdtemp()) as writer:
        sink = Sink(writer)
        sink.scalars({tags.LOSS_SCALE: 1024.0, tags.OVERFLOW: 0.0}, step=0)   # one event, both values
        sink.record(tags.SKIP_RECORD, {"step": 3, "params": ["net.0.weight"]}, step=3)
    ```
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any, Optional
from weakref import WeakSet

from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
from tensorboard.compat.proto.tensor_pb2 import TensorProto
from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto

from lightning_mpt._compat import event_file_writer
from lightning_mpt.diagnostics import tags
from lightning_mpt.diagnostics.dashboard import layout_dict

#: a histogram's buckets: their right edges and their counts
Histogram = tuple[list[float], list[float]]

# SummaryWriters that hold the dashboard layout already: one layout per event-file directory, also when a second
# fit writes to the same logger (a weak set, so that it never keeps a writer alive)
_LAYOUT_WRITTEN: WeakSet[Any] = WeakSet()


class Sink:
    """Writes scalars, histograms, texts and records to TensorBoard ``SummaryWriter`` s, and scalars to loggers.

    Args:
        summary_writer: a ``torch.utils.tensorboard.SummaryWriter`` (``TensorBoardLogger.experiment``), a sequence
            of them (each gets everything), or ``None``.
        loggers: objects with ``log_metrics(metrics: dict, step: int)`` (Lightning loggers: CSV, W&B, ...) that get
            the scalars; histograms, texts and records need TensorBoard and are dropped for them.

    A sink without either is inactive (``active`` is ``False``): the monitors then skip their work. Each call of
    :meth:`scalars` writes its values as **one** TensorBoard event per writer.
    """

    def __init__(self, summary_writer: Any = None, loggers: Sequence[Any] = ()) -> None:
        found = summary_writer if isinstance(summary_writer, (list, tuple)) else [summary_writer]
        self.writers: list[Any] = []
        for writer in found:  # a writer given twice writes once
            if writer is not None and all(writer is not w for w in self.writers):
                self.writers.append(writer)
        self.loggers = list(loggers)

    @classmethod
    def for_loggers(cls, loggers: Sequence[Any], tensorboard_logger: type[Any]) -> Sink:
        """The sink of a list of Lightning loggers (``trainer.loggers``, ``fabric.loggers``): every logger of class
        ``tensorboard_logger`` (Lightning's ``TensorBoardLogger``, passed in by the front-end) gets everything, through
        its ``experiment``; without one, the other loggers get the scalars.

        Example:
            ```python
            import tempfile

            from lightning.fabric.loggers import TensorBoardLogger
            from lightning_mpt.diagnostics.sink import Sink

            boards = [TensorBoardLogger(tempfile.mkdtemp()), TensorBoardLogger(tempfile.mkdtemp())]
            assert Sink.for_loggers(boards, TensorBoardLogger).writers == [b.experiment for b in boards]
            ```
        """
        boards = [lg.experiment for lg in loggers if isinstance(lg, tensorboard_logger)]
        return cls(boards) if boards else cls(loggers=loggers)

    @property
    def active(self) -> bool:
        return bool(self.writers) or bool(self.loggers)

    def flush(self) -> None:
        """Write what the TensorBoard writers still buffer to disk (they flush on a timer otherwise), so that a
        process that dies afterwards (gloo's abort at exit, a kill) loses no event; other loggers save."""
        for writer in self.writers:
            writer.flush()
        for logger in self.loggers:
            save = getattr(logger, "save", None)
            if callable(save):
                save()

    def scalars(self, values: dict[str, Optional[float]], step: int) -> None:
        """Write ``values`` (tag -> value; ``None`` values are left out) at ``step``."""
        values = {k: float(v) for k, v in values.items() if v is not None}
        if not values:
            return
        if self.writers:
            summary = Summary(value=[Summary.Value(tag=tag, simple_value=v) for tag, v in values.items()])
            for writer in self.writers:
                event_file_writer(writer).add_summary(summary, step)
        for logger in self.loggers:
            logger.log_metrics(values, step)

    def histogram_raw(self, tag: str, step: int, **kwargs: Any) -> None:
        """``SummaryWriter.add_histogram_raw(tag, global_step=step, **kwargs)`` (TensorBoard only)."""
        for writer in self.writers:
            writer.add_histogram_raw(tag, global_step=step, **kwargs)

    def histogram(
        self, tag: str, step: int, low: float, high: float, sums: tuple[float, float, float], buckets: Histogram
    ) -> None:
        """A histogram from ``low`` to ``high`` with ``sums`` ``(count, sum, sum of squares)`` and ``buckets``
        ``(right edges, counts)``; runs of empty buckets are merged (TensorBoard draws the same picture from fewer
        bytes)."""
        limits, counts = _merge_empty(*buckets)
        num, total, squares = sums
        self.histogram_raw(
            tag,
            step,
            min=low,
            max=high,
            num=num,
            sum=total,
            sum_squares=squares,
            bucket_limits=limits,
            bucket_counts=counts,
        )

    def text(self, tag: str, text: str, step: int) -> None:
        """A Markdown text for TensorBoard's Text tab (TensorBoard only; stored as ``tag + tags.TEXT_SUFFIX``)."""
        for writer in self.writers:
            writer.add_text(tag, text, step)

    def record(self, tag: str, data: dict[str, Any], step: int) -> None:
        """A record for programs: ``data`` as JSON (with ``"schema"`` added) in a string tensor summary of the
        plugin :data:`lightning_mpt.diagnostics.tags.PLUGIN_NAME` (TensorBoard only). Read back with
        ``EventAccumulator.Tensors(tag)``; see :func:`decode_record`."""
        if not self.writers:
            return
        payload = json.dumps({"schema": tags.RECORD_SCHEMA, **data}, allow_nan=False).encode()
        metadata = SummaryMetadata(
            plugin_data=SummaryMetadata.PluginData(plugin_name=tags.PLUGIN_NAME, content=b"json"),
            summary_description="lightning-mpt record (JSON); read by lightning-mpt report",
        )
        tensor = TensorProto(dtype="DT_STRING", string_val=[payload], tensor_shape=TensorShapeProto())
        summary = Summary(value=[Summary.Value(tag=tag, tensor=tensor, metadata=metadata)])
        for writer in self.writers:
            event_file_writer(writer).add_summary(summary, step)

    def layout(self, charts: Optional[Iterable[str]] = None) -> bool:
        """Write the "Mixed precision" custom-scalars layout with ``charts`` (keys of
        :data:`~lightning_mpt.diagnostics.dashboard.CHARTS`, all by default) to each writer that holds none yet; return
        whether it wrote."""
        charts = None if charts is None else list(charts)
        if charts == []:
            return False
        wrote = False
        for writer in self.writers:
            if writer not in _LAYOUT_WRITTEN:
                writer.add_custom_scalars(layout_dict(charts))
                _LAYOUT_WRITTEN.add(writer)
                wrote = True
        return wrote


def _merge_empty(limits: Sequence[float], counts: Sequence[float]) -> Histogram:
    out_limits: list[float] = []
    out_counts: list[float] = []
    for limit, count in zip(limits, counts):
        if count == 0 and out_counts and out_counts[-1] == 0:
            out_limits[-1] = limit
        else:
            out_limits.append(limit)
            out_counts.append(count)
    return out_limits, out_counts


def decode_record(tensor_proto: Any) -> dict[str, Any]:
    """The JSON object of a record's ``TensorProto`` (``EventAccumulator.Tensors(tag)[i].tensor_proto``)."""
    data = json.loads(tensor_proto.string_val[0].decode())
    if not isinstance(data, dict):
        raise ValueError(f"a lightning-mpt record holds a JSON object, not {type(data).__name__}")
    return data
