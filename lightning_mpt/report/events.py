"""The event files of a TensorBoard log directory, read for ``lightning-mpt report``: each run's ``mpt/`` scalars, its
records and its last exponent histograms, and what could not be read.

The runs are the folders :func:`~lightning_mpt.report.folders.find_runs` finds (each real folder once, links
followed without loops). Each run's event files are read with TensorBoard's own reader (``EventAccumulator``, every
scalar kept), one file at a time in name order, so that a file that cannot be opened loses that file only.
TensorBoard's reader stops quietly at a damaged record: each event file's framing is checked first
(:func:`check_event_file`). Records are checked before use (:mod:`lightning_mpt.report.records`).

Example:
    ```python
    runs, ignored = load_runs("runs")
    print(runs[0].name, runs[0].series("mpt/loss_scale")[:3], ignored)
    ```
"""

from __future__ import annotations

import struct
from collections import Counter
from pathlib import Path
from typing import Any, Optional, Union

from tensorboard.backend.event_processing import event_accumulator
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

from lightning_mpt.diagnostics import exponent_axis, tags
from lightning_mpt.report.data import ExponentHistogram, ReportError, RunData
from lightning_mpt.report.folders import RunFolders, find_runs, is_event_file
from lightning_mpt.report.records import check_record, decode

__all__ = ["check_event_file", "decode_exponent_histogram", "load_runs", "read_runs", "unreadable_files"]

_SIZE_GUIDANCE = {
    event_accumulator.SCALARS: 0,  # 0: keep every point
    event_accumulator.TENSORS: 0,  # the records (mpt/data/*) and texts
    event_accumulator.HISTOGRAMS: 1,  # the reservoir always keeps the last one: the "last logged gradients"
    event_accumulator.COMPRESSED_HISTOGRAMS: 1,
    event_accumulator.IMAGES: 1,
    event_accumulator.AUDIO: 1,
}


def load_runs(logdir: Union[str, Path]) -> tuple[list[RunData], list[str]]:
    """Read every run under ``logdir``: the runs with ``mpt/`` tags, and the names of the runs without.

    Raises :class:`~lightning_mpt.report.data.ReportError` for a missing directory or one without event files.

    Example:
        ```python
        runs, ignored = load_runs("runs")
        scales = runs[0].series("mpt/loss_scale")          # [(step, scale), ...], every point
        flush = runs[0].per_parameter("mpt/grad_underflow_fraction")   # {param name: [(step, fraction), ...]}
        ```
    """
    return read_runs(find_runs(logdir))


def read_runs(found: RunFolders) -> tuple[list[RunData], list[str]]:
    """Read the runs ``found``: those with ``mpt/`` tags, and the names of those without.

    A run whose records are all unreadable and that has nothing else goes to ``found.unreadable``. Raises
    :class:`~lightning_mpt.report.data.ReportError` when no folder holds event files.

    Args:
        found: the run folders (:func:`~lightning_mpt.report.folders.find_runs`).

    Example:
        ```python
        from lightning_mpt.report.folders import find_runs

        found = find_runs("runs")
        runs, ignored = read_runs(found)
        print([r.name for r in runs], ignored, found.unreadable)
        ```
    """
    if not found.runs and not found.unreadable:
        raise ReportError(
            f"{found.root}: no TensorBoard event files (events.out.tfevents.*) in it or below it; expected the "
            "log directory of a run trained with a TensorBoardLogger."
        )
    runs, ignored = [], []
    for name, path in found.runs.items():
        accumulators = [a for f in _event_files(path) if (a := _accumulate(f)) is not None]
        run = _read_run(name, path, accumulators)
        if run.scalars or run.records or run.exponents is not None:
            runs.append(run)
        elif run.unreadable:  # records only, none of them readable: nothing of it to report
            found.unreadable[name] = f"its records cannot be read, and it logged no scalars: {run.unreadable}"
        else:
            ignored.append(name)
    return runs, ignored


def _event_files(folder: Path) -> list[Path]:
    """The event files of a run's folder in name order (TensorBoard's order: by the time each was opened), folders
    named like one left out (TensorBoard's own directory reader would stop at them)."""
    try:
        return sorted(f for f in folder.iterdir() if is_event_file(f.name) and f.is_file())
    except OSError:  # the folder went away or cannot be listed: find_runs names such folders
        return []


def _accumulate(path: Path) -> Optional[event_accumulator.EventAccumulator]:
    """Every event of one event file (TensorBoard's reader), ``None`` when it cannot be opened (the file check names
    it, see :func:`unreadable_files`)."""
    acc = event_accumulator.EventAccumulator(str(path), size_guidance=_SIZE_GUIDANCE)
    try:
        acc.Reload()
    except OSError:
        return None
    return acc


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
    try:
        size = path.stat().st_size
        f = open(path, "rb")  # noqa: SIM115  (closed below; an open that fails is an answer, not an error)
    except OSError as error:
        return f"it cannot be read ({error.strerror.lower() if error.strerror else type(error).__name__})", 0
    offset = index = 0
    with f:
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
    """The event files of ``runs`` that are truncated, corrupt or cannot be opened, and the runs of which nothing can
    be read (every event file damaged in its first record).

    Args:
        root: the log directory.
        runs: the runs' names, relative to ``root``.

    Returns:
        ``{event file relative to root: what is wrong}`` and the names of the runs lost whole.

    Example:
        ```python
        from pathlib import Path

        damaged, lost = unreadable_files(Path("runs"), ["demo/version_0"])
        assert damaged == {} and lost == set()
        ```
    """
    found, lost = {}, set()
    for run in runs:
        files = _event_files(root / run)
        checked = {f: _check_frames(f) for f in files}
        for f, (what, _) in checked.items():
            if what is not None:
                found[(Path(run) / f.name).as_posix()] = what
        if files and all(what is not None and whole == 0 for what, whole in checked.values()):
            lost.add(run)
    return dict(sorted(found.items())), lost


def _read_run(name: str, path: Path, accumulators: list[event_accumulator.EventAccumulator]) -> RunData:
    """One run from the events of its files, read in file order."""
    scalars: dict[str, dict[int, float]] = {}
    last: dict[str, Any] = {}
    for acc in accumulators:
        found = acc.Tags()
        # one point per step, the last written: a run resumed into its own log directory from a checkpoint older
        # than its last logged step logs those steps again (torch's writer marks no restart)
        for tag in found["scalars"]:
            if tag.startswith(tags.PREFIX):
                scalars.setdefault(tag, {}).update((e.step, e.value) for e in acc.Scalars(tag))
        for tag in found["histograms"]:
            if tags.parameter_of(tags.GRAD_EXPONENT, tag):
                last[tag] = acc.Histograms(tag)[-1]
    records, unreadable = _records(accumulators)
    points = {tag: sorted(values.items()) for tag, values in scalars.items()}
    return RunData(name, path, points, records, _last_exponents(last), unreadable)


def _records(
    accumulators: list[event_accumulator.EventAccumulator],
) -> tuple[dict[str, list[tuple[int, dict[str, Any]]]], Optional[str]]:
    """The run's records by tag, or none and what is wrong with the first bad one (then the run is read from its
    scalars alone: a summary half from records and half from guesses would be wrong without saying so)."""
    records: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    bad: list[str] = []
    for acc in accumulators:
        try:
            record_tags = sorted(acc.PluginTagToContent(tags.PLUGIN_NAME))  # the records: found by their plugin name
        except KeyError:  # no records in this file
            continue
        for tag in record_tags:
            for event in acc.Tensors(tag):
                try:
                    record = decode(event.tensor_proto)
                    what = check_record(tag, record)
                except ValueError as error:
                    what = str(error)
                if what is not None:
                    bad.append(f"{tag} at step {event.step}: {what}")
                else:
                    records.setdefault(tag, []).append((event.step, record))
    if not bad:
        return records, None
    more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
    return {}, f"{bad[0]}{more}"


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
