"""The event files of a TensorBoard log directory, read for ``lightning-mpt report``: each run's ``mpt/`` scalars, its
records and its last exponent histograms, and the event files that are damaged.

The event files are read with TensorBoard's own reader (``EventMultiplexer``, every scalar kept). Every directory
under the log directory that holds event files is a run. TensorBoard's reader stops quietly at a damaged record: each
event file's framing is checked first (:func:`check_event_file`).
"""

from __future__ import annotations

import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

from tensorboard.backend.event_processing import event_accumulator
from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

from lightning_mpt.diagnostics import exponent_axis, tags
from lightning_mpt.diagnostics.exponent_axis import FORMATS, FloatFormat
from lightning_mpt.diagnostics.sink import decode_record

__all__ = [
    "ExponentHistogram",
    "ReportError",
    "RunData",
    "check_event_file",
    "decode_exponent_histogram",
    "load_runs",
    "unreadable_files",
]

_SIZE_GUIDANCE = {
    event_accumulator.SCALARS: 0,  # 0: keep every point
    event_accumulator.TENSORS: 0,  # the records (mpt/data/*) and texts
    event_accumulator.HISTOGRAMS: 1,  # the reservoir always keeps the last one: the "last logged gradients"
    event_accumulator.COMPRESSED_HISTOGRAMS: 1,
    event_accumulator.IMAGES: 1,
    event_accumulator.AUDIO: 1,
}

Series = list[tuple[int, float]]
Records = list[tuple[int, dict[str, Any]]]


class ReportError(ValueError):
    """The log directory cannot be reported on; the message says what was wrong and what is expected."""


@dataclass(frozen=True)
class ExponentHistogram:
    """The exponent histogram of stored half gradients (``mpt/grad_exponent/*``) at one step, summed over the
    parameters logged at that step: ``counts[e]`` values with ``floor(log2|g * scale|) == e``."""

    step: int
    format: str
    zero: float
    nonfinite: float
    counts: dict[int, float]
    parameters: list[str]

    @property
    def fmt(self) -> FloatFormat:
        return next(f for f in FORMATS if f.name == self.format)


@dataclass
class RunData:
    """What was read from one run's event files: its ``mpt/`` scalars, its records (``mpt/data/*``, decoded JSON
    objects in step order) and the last exponent histograms."""

    name: str  # path relative to the log directory ("." for the log directory itself)
    path: Path
    scalars: dict[str, Series]
    records: dict[str, Records]
    exponents: Optional[ExponentHistogram]

    def series(self, tag: str) -> Series:
        return self.scalars.get(tag, [])

    def record_list(self, tag: str) -> list[dict[str, Any]]:
        """The records of ``tag`` (e.g. :data:`lightning_mpt.diagnostics.tags.SKIP_RECORD`), in step order."""
        return [r for _, r in self.records.get(tag, [])]

    def per_parameter(self, tag: str) -> dict[str, Series]:
        """``{parameter name: series}`` of the tags ``<tag>/<parameter name>``."""
        prefix = tag + "/"
        return {t[len(prefix) :]: s for t, s in self.scalars.items() if t.startswith(prefix)}


def load_runs(logdir: Union[str, Path]) -> tuple[list[RunData], list[str]]:
    """Read every run under ``logdir``: the runs with ``mpt/`` tags, and the names of the runs without.

    Raises :class:`ReportError` for a missing directory or one without event files.

    Example:
        ```python
        runs, ignored = load_runs("runs")
        scales = runs[0].series("mpt/loss_scale")          # [(step, scale), ...], every point
        flush = runs[0].per_parameter("mpt/grad_underflow_fraction")   # {param name: [(step, fraction), ...]}
        ```
    """
    root = Path(logdir)
    if not root.exists():
        raise ReportError(
            f"{root}: no such directory; expected a TensorBoard log directory (a TensorBoardLogger's "
            "save_dir, or one run's version_N folder)."
        )
    if not root.is_dir():
        raise ReportError(f"{root}: not a directory; expected a TensorBoard log directory, not a file.")
    mux = EventMultiplexer(size_guidance=_SIZE_GUIDANCE).AddRunsFromDirectory(str(root))
    mux.Reload()
    names = sorted(mux.Runs())
    if not names:
        raise ReportError(
            f"{root}: no TensorBoard event files (events.out.tfevents.*) in it or below it; expected the "
            "log directory of a run trained with a TensorBoardLogger."
        )
    runs, ignored = [], []
    for name in names:
        run = _read_run(name, root / name, mux.GetAccumulator(name))
        if run.scalars or run.records or run.exponents is not None:
            runs.append(run)
        else:
            ignored.append(name)
    return runs, ignored


_FRAME = struct.Struct("<QI")  # a record's length and the masked CRC-32C of those 8 bytes; then data, its CRC


def check_event_file(path: Union[str, Path]) -> Optional[str]:
    """What is wrong with the TensorBoard event file ``path``; ``None`` when each of its records is whole.

    An event file is a sequence of records, each an 8-byte length, the checksum of that length, the serialized event
    and the event's checksum (TensorBoard's TFRecord framing). TensorBoard's reader stops quietly at the first record
    it cannot read; this walks the frames (each length and its checksum, not the events' own checksums, which the
    reader checks) and says where the file is cut short or stops being an event file.

    Example:
        ```python
        import tempfile
        from pathlib import Path

        path = Path(tempfile.mkdtemp(), "events.out.tfevents.0.host")
        path.write_bytes(b"not an event file")
        assert check_event_file(path).startswith("not a TensorBoard event file")
        ```
    """
    return _check_frames(Path(path))[0]


def _check_frames(path: Path) -> tuple[Optional[str], int]:
    """:func:`check_event_file`'s answer and the number of whole records before the first damaged one."""
    size = path.stat().st_size
    offset = index = 0
    with open(path, "rb") as f:
        while offset < size:
            frame = f.read(_FRAME.size)
            length, checksum = _FRAME.unpack(frame) if len(frame) == _FRAME.size else (0, None)
            if checksum is not None and masked_crc32c(frame[:8]) != checksum:
                if index == 0:
                    return (
                        "not a TensorBoard event file: its first record's length checksum does not match (another "
                        "kind of file, or its first bytes are damaged); nothing in it can be read"
                    ), 0
                return (
                    f"corrupt at byte {offset}: the length checksum of record {index + 1} does not match; only the "
                    f"{index} records before it are read"
                ), index
            end = offset + _FRAME.size + length + 4
            if checksum is None or end > size:
                read = f"only the {index} whole records before it are read" if index else "nothing in it can be read"
                return (
                    f"truncated: it ends at byte {size}, inside record {index + 1} (from byte {offset}); the writing "
                    f"process stopped mid-record, or the file was cut short; {read}"
                ), index
            f.seek(end)
            offset, index = end, index + 1
    return None, index


def unreadable_files(root: Path, runs: list[str]) -> tuple[dict[str, str], set[str]]:
    """The event files of ``runs`` that are truncated or corrupt, ``{path relative to root: what is wrong}``, and the
    runs of which nothing can be read (every event file damaged in its first record)."""
    found, lost = {}, set()
    for run in runs:
        files = sorted(f for f in (root / run).iterdir() if "tfevents" in f.name and f.is_file())
        checked = {f: _check_frames(f) for f in files}
        for f, (what, _) in checked.items():
            if what is not None:
                found[str(f.relative_to(root))] = what
        if files and all(what is not None and whole == 0 for what, whole in checked.values()):
            lost.add(run)
    return dict(sorted(found.items())), lost


def _read_run(name: str, path: Path, acc: event_accumulator.EventAccumulator) -> RunData:
    found = acc.Tags()
    # one point per step, the last written: a run resumed into its own log directory from a checkpoint older than
    # its last logged step logs those steps again (TensorBoard's reader keeps both: torch's writer marks no restart)
    scalars = {
        t: sorted({e.step: e.value for e in acc.Scalars(t)}.items())
        for t in found["scalars"]
        if t.startswith(tags.PREFIX)
    }
    try:
        record_tags = sorted(acc.PluginTagToContent(tags.PLUGIN_NAME))  # the records: found by their plugin name
    except KeyError:  # no records in this run
        record_tags = []
    records = {t: [(e.step, decode_record(e.tensor_proto)) for e in acc.Tensors(t)] for t in record_tags}
    exponent_tags = [t for t in found["histograms"] if tags.parameter_of(tags.GRAD_EXPONENT, t)]
    last = {t: acc.Histograms(t)[-1] for t in exponent_tags}
    return RunData(name, path, scalars, records, _last_exponents(last))


def _last_exponents(last: dict[str, Any]) -> Optional[ExponentHistogram]:
    """Sum the exponent histograms of the last step any parameter's was logged at."""
    if not last:
        return None
    step = max(e.step for e in last.values())
    decoded: dict[str, ExponentHistogram] = {}
    for tag, e in sorted(last.items()):
        name = tags.parameter_of(tags.GRAD_EXPONENT, tag)
        h = decode_exponent_histogram(e.histogram_value, step) if e.step == step else None
        if name is not None and h is not None:
            decoded[name] = h
    if not decoded:
        return None
    counts: Counter[int] = Counter()
    for h in decoded.values():
        counts.update(h.counts)
    first = next(iter(decoded.values()))
    return ExponentHistogram(
        step=step,
        format=first.format,
        zero=sum(h.zero for h in decoded.values()),
        nonfinite=sum(h.nonfinite for h in decoded.values()),
        counts=dict(sorted(counts.items())),
        parameters=list(decoded),
    )


def decode_exponent_histogram(h: Any, step: int) -> Optional[ExponentHistogram]:
    """The counts per exponent in one ``HistogramProto`` of ``mpt/grad_exponent/*`` written at ``step`` (its axis:
    :mod:`lightning_mpt.diagnostics.exponent_axis`); ``None`` when its range is neither fp16's nor bf16's."""
    decoded = exponent_axis.decode(h.min, h.max, h.bucket_limit, h.bucket)
    if decoded is None:
        return None
    fmt, zero, nonfinite, counts = decoded
    return ExponentHistogram(step, fmt.name, zero, nonfinite, counts, [])
