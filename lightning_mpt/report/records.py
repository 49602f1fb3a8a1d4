"""The records (``mpt/data/*``) of a run, decoded and checked before the report reads a field of them.

A record is a JSON object with a ``"schema"`` number (:data:`lightning_mpt.diagnostics.tags.RECORD_SCHEMA`) and the
fields of :data:`lightning_mpt.diagnostics.tags.RECORD_FIELDS`. This report reads schema 1; a record of another
schema (written by another version of lightning-mpt), one that is not JSON, not an object, or whose fields are of
the wrong type makes :func:`check_record` say what is wrong, and the report leaves that run's records out rather than
guess (the run is then summarised from its scalars).

Example:
    ```python
    from lightning_mpt.diagnostics import tags

    assert check_record(tags.SKIP_RECORD, {"schema": 1, "step": 3, "params": ["net.0.weight"]}) is None
    assert check_record(tags.SKIP_RECORD, {"schema": 1, "step": None}) == "step is null, expected an integer"
    assert check_record(tags.SKIP_RECORD, {"schema": 2, "step": 3}).startswith("schema 2;")
    assert check_record(tags.SKIP_RECORD, ["not", "an", "object"]) == "a JSON array, expected an object"
    ```
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Optional

from lightning_mpt.diagnostics import tags

__all__ = ["check_record", "decode"]

Check = Callable[[Any], bool]


def _integer(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _optional(check: Check) -> Check:
    return lambda x: x is None or check(x)


def _names(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(n, str) for n in x)


def _counts(x: Any) -> bool:
    return isinstance(x, dict) and all(isinstance(k, str) and _integer(v) for k, v in x.items())


# the fields the report reads, per record tag, with what each must be and how it is said; a field that is absent is
# read as missing (older writers lack some), one that is present must be of its type
_FIELDS: dict[str, dict[str, tuple[Check, str]]] = {
    tags.RUN_RECORD: {
        "format": (_optional(lambda x: isinstance(x, str)), "a string or null"),
        "loss_scaling": (_optional(lambda x: isinstance(x, str)), "a string or null"),
        "precision": (_optional(lambda x: isinstance(x, str)), "a string or null"),
        "scaler": (_optional(lambda x: isinstance(x, dict)), "an object or null"),
        "master_weights": (_optional(lambda x: isinstance(x, bool)), "true, false or null"),
    },
    tags.SKIP_RECORD: {
        "step": (_integer, "an integer"),
        "scale": (_optional(_number), "a number or null"),
        "scale_after": (_optional(_number), "a number or null"),
        "params": (_names, "an array of names"),
        "loss_finite": (_optional(lambda x: isinstance(x, bool)), "true, false or null"),
    },
    tags.STOP_RECORD: {
        "step": (_integer, "an integer"),
        "error": (_optional(lambda x: isinstance(x, str)), "a string or null"),
        "message": (_optional(lambda x: isinstance(x, str)), "a string or null"),
    },
    tags.SUMMARY_RECORD: {
        "step": (_integer, "an integer"),
        "skipped_steps": (_optional(_integer), "an integer or null"),
        "params": (_counts, "an object of counts"),
    },
}
_REQUIRED = {tags.SKIP_RECORD: ("step",), tags.STOP_RECORD: ("step",), tags.SUMMARY_RECORD: ("step",)}
_JSON_TYPES = {
    dict: "a JSON object",
    list: "a JSON array",
    str: "a JSON string",
    int: "a JSON number",
    float: "a JSON number",
    bool: "a JSON boolean",
}


def decode(tensor_proto: Any) -> Any:
    """The JSON value of a record's ``TensorProto``; raises ``ValueError`` when it holds no JSON text.

    Args:
        tensor_proto: ``EventAccumulator.Tensors(tag)[i].tensor_proto`` of a record's tag.

    Example:
        ```python
        from tensorboard.compat.proto.tensor_pb2 import TensorProto

        assert decode(TensorProto(dtype="DT_STRING", string_val=[b'{"schema": 1}'])) == {"schema": 1}
        ```
    """
    try:
        return json.loads(tensor_proto.string_val[0].decode())
    except (IndexError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"not JSON ({error})") from None


def check_record(tag: str, record: Any) -> Optional[str]:
    """What is wrong with ``record`` of ``tag`` for this report; ``None`` when it can be read.

    Args:
        tag: the record's tag (``mpt/data/...``).
        record: its decoded JSON value (:func:`decode`).

    Example:
        ```python
        from lightning_mpt.diagnostics import tags

        assert check_record(tags.SUMMARY_RECORD, {"schema": 1, "step": 9, "params": ["a"]}) == (
            "params is a JSON array, expected an object of counts"
        )
        ```
    """
    if not isinstance(record, dict):
        return f"{_JSON_TYPES.get(type(record), 'null' if record is None else 'a JSON value')}, expected an object"
    schema = record.get("schema")
    if schema != tags.RECORD_SCHEMA or isinstance(schema, bool):
        said = "no schema number" if schema is None else f"schema {json.dumps(schema)}"
        return (
            f"{said}; this lightning-mpt reads schema {tags.RECORD_SCHEMA} (a record written by another version of "
            "lightning-mpt: report it with that version)"
        )
    fields = _FIELDS.get(tag, {})
    for name in _REQUIRED.get(tag, ()):
        if name not in record:
            return f"{name} is missing"
    for name, (check, expected) in fields.items():
        if name in record and not check(record[name]):
            value = record[name]
            what = "null" if value is None else _JSON_TYPES.get(type(value), f"a JSON {type(value).__name__}")
            return f"{name} is {what}, expected {expected}"
    return None
