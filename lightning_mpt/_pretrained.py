"""Hugging Face ``save_pretrained`` during training under either plugin: the files say fp32, as the tensors saved are.

A ``transformers`` model inside the converted module writes, in ``save_pretrained``, its ``state_dict()`` (which holds
the fp32 masters under the plugin) and a ``config.json`` whose ``dtype`` (``torch_dtype`` before transformers 5) is
that of its first floating-point parameter: a half one during training. ``from_pretrained`` then loads the fp32
masters into a half-precision model, rounded. While the module is converted, the plugin gives each such model's
``save_pretrained`` (an instance attribute, which ``push_to_hub`` calls too) the correction: once the files are
written, a half ``dtype`` in ``config.json`` and in the model's config becomes ``float32``. So a save during training
reloads as the masters, exactly, as a save after ``fit`` (when the module is fp32 again) does.

The models are recognised by what transformers' ``save_pretrained`` relies on (a ``save_pretrained`` method and a
``config``); nothing here imports transformers.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor
from torch.nn import Module

__all__ = ["SavedAsMasters"]

# the config keys transformers writes the model's dtype under: "dtype" (>= 5), "torch_dtype" (4.x)
_DTYPE_KEYS = ("dtype", "torch_dtype")
_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


class SavedAsMasters:
    """While a module is converted, the ``save_pretrained`` of every Hugging Face model in it writes ``float32`` as the
    dtype of the fp32 masters it saves.

    Args:
        half: the half-precision format of the converted weights.

    Example:
        ```python
        import json
        import tempfile
        from pathlib import Path

        class Pretrained(torch.nn.Linear):  # what transformers' save_pretrained does, in short
            config = {"dtype": None}

            def save_pretrained(self, directory):
                self.config["dtype"] = str(self.weight.dtype).split(".")[1]  # the first parameter's dtype
                Path(directory, "config.json").write_text(json.dumps(self.config))

        model = Pretrained(2, 2).half()  # converted: half weights, fp32 masters in its state_dict
        saves = SavedAsMasters(torch.float16)
        saves.watch(model)
        with tempfile.TemporaryDirectory() as directory:
            model.save_pretrained(directory)
            assert json.loads(Path(directory, "config.json").read_text())["dtype"] == "float32"
        saves.close()
        ```
    """

    def __init__(self, half: torch.dtype) -> None:
        self._half = _NAMES[half]
        self._models: list[Module] = []

    def watch(self, module: Module) -> None:
        """Correct the ``save_pretrained`` of the Hugging Face models in ``module`` until :meth:`close`."""
        for model in module.modules():
            save = getattr(model, "save_pretrained", None)
            if callable(save) and hasattr(model, "config") and "save_pretrained" not in vars(model):
                model.__dict__["save_pretrained"] = self._corrected(model, save)
                self._models.append(model)

    def close(self) -> None:
        """Give the models their own ``save_pretrained`` back (the module is fp32 again)."""
        for model in self._models:
            model.__dict__.pop("save_pretrained", None)
        self._models.clear()

    def _corrected(self, model: Module, save: Callable[..., Any]) -> Callable[..., Any]:
        def save_pretrained(save_directory: Any, *args: Any, **kwargs: Any) -> Any:
            result = save(save_directory, *args, **kwargs)
            given = kwargs.get("state_dict")
            if given is None or _first_float_dtype(given) == torch.float32:  # what was saved: the fp32 masters
                _correct_config(model.config, self._half)
                path = Path(save_directory) / "config.json"
                if path.is_file():  # written by the main process only
                    saved = json.loads(path.read_text(encoding="utf-8"))
                    if _correct_config(saved, self._half):
                        path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n", encoding="utf-8")
            return result

        save_pretrained.__doc__ = save.__doc__
        return save_pretrained


def _correct_config(config: Any, half: str) -> bool:
    """Set a ``half`` dtype entry of ``config`` (a dict or a transformers config) to ``float32``; whether one was."""
    changed = False
    for key in _DTYPE_KEYS:
        value = config.get(key) if isinstance(config, dict) else getattr(config, key, None)
        if str(value).removeprefix("torch.") == half:
            if isinstance(config, dict):
                config[key] = "float32"
            else:
                setattr(config, key, "float32")
            changed = True
    return changed


def _first_float_dtype(state_dict: Mapping[str, Any]) -> Optional[torch.dtype]:
    return next((v.dtype for v in state_dict.values() if isinstance(v, Tensor) and v.is_floating_point()), None)
