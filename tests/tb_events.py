"""Reading TensorBoard event files in the tests, with TensorBoard's own reader (one helper for every test file)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Union

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.plugins.custom_scalar.metadata import CONFIG_SUMMARY_TAG

from lightning_mpt.diagnostics import tags
from lightning_mpt.diagnostics.sink import decode_record

PathLike = Union[str, Path]


def read_events(log_dir: PathLike) -> EventAccumulator:
    """Every event under ``log_dir`` (one run's folder), nothing sampled away."""
    ea = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    ea.Reload()
    return ea


def series(ea: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    """``(step, value)`` of a scalar tag."""
    return [(e.step, e.value) for e in ea.Scalars(tag)]


def all_scalars(log_dir: PathLike) -> dict[str, list[float]]:
    """Every scalar series of ``log_dir``, values only."""
    ea = read_events(log_dir)
    return {tag: [e.value for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}


def texts(ea: EventAccumulator, tag: str) -> list[tuple[int, str]]:
    """``(step, text)`` of a text written with ``SummaryWriter.add_text(tag, ...)``."""
    return [(e.step, e.tensor_proto.string_val[0].decode()) for e in ea.Tensors(tag + tags.TEXT_SUFFIX)]


def records(ea: EventAccumulator, tag: str) -> list[tuple[int, dict[str, Any]]]:
    """``(step, JSON object)`` of a record tag (``mpt/data/*``); checks that it carries lightning-mpt's plugin."""
    try:
        found = ea.PluginTagToContent(tags.PLUGIN_NAME)
    except KeyError:  # no record at all in this run
        found = {}
    assert tag in found, f"no {tags.PLUGIN_NAME} record {tag!r} in this run; records: {sorted(found)}"
    return [(e.step, decode_record(e.tensor_proto)) for e in ea.Tensors(tag)]


def layouts(ea: EventAccumulator) -> list[layout_pb2.Layout]:
    """The custom-scalars layouts written to the run."""
    return [layout_pb2.Layout.FromString(e.tensor_proto.string_val[0]) for e in ea.Tensors(CONFIG_SUMMARY_TAG)]


def write_record(log_dir: PathLike, tag: str, payload: bytes, step: int) -> None:
    """Write ``payload`` (any bytes, JSON or not) as a lightning-mpt record of ``tag`` at ``step`` into a new event
    file in ``log_dir``: the framing of a real record around contents ``Sink.record`` would never write."""
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.compat.proto.tensor_pb2 import TensorProto
    from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
    from torch.utils.tensorboard import SummaryWriter

    from lightning_mpt._compat import event_file_writer

    metadata = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name=tags.PLUGIN_NAME, content=b"json"))
    tensor = TensorProto(dtype="DT_STRING", string_val=[payload], tensor_shape=TensorShapeProto())
    with SummaryWriter(str(log_dir), filename_suffix=".bad") as writer:
        summary = Summary(value=[Summary.Value(tag=tag, tensor=tensor, metadata=metadata)])
        event_file_writer(writer).add_summary(summary, step)
