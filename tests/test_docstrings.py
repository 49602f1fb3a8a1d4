"""Every ```python example in a docstring of the package runs, in its module's namespace (as doctest would)."""

import importlib
import inspect
import pkgutil
import re
import textwrap

import pytest
import torch.distributed.fsdp

import lightning_mpt

FENCE = re.compile(r"```python\n(.*?)```", re.S)
# modules that need a torch feature this torch may lack: FSDP2 is public from torch 2.6
NEEDS = {"lightning_mpt.core.masters.sharded": hasattr(torch.distributed.fsdp, "fully_shard")}


def docstring_examples():
    for info in pkgutil.walk_packages(lightning_mpt.__path__, "lightning_mpt."):
        if not NEEDS.get(info.name, True):
            continue
        module = importlib.import_module(info.name)
        objects = [("", module)]
        for name, obj in vars(module).items():
            if getattr(obj, "__module__", None) != module.__name__ or name.startswith("_"):
                continue
            objects.append((name, obj))
            if inspect.isclass(obj):
                objects += [(f"{name}.{n}", m) for n, m in vars(obj).items() if not n.startswith("_")]
        for qualname, obj in objects:
            doc = inspect.getdoc(obj if not isinstance(obj, property) else obj.fget) or ""
            for i, code in enumerate(FENCE.findall(doc)):
                yield pytest.param(module, textwrap.dedent(code), id=f"{module.__name__}:{qualname or '<module>'}:{i}")


@pytest.fixture(scope="session")
def runs_dir(tmp_path_factory):
    """A real TensorBoard log with the diagnostics, for the examples that read ``runs/``."""
    import lightning as L
    from models import InjectInf, TinyMLP, quiet_trainer, regression_data

    from lightning_mpt import MPTPrecision
    from lightning_mpt.callbacks import GradientHistogramMonitor, LossScaleMonitor, UnderflowMonitor

    root = tmp_path_factory.mktemp("logs") / "runs"
    callbacks = [
        LossScaleMonitor(),
        GradientHistogramMonitor(every_n_steps=2),
        UnderflowMonitor(every_n_steps=2, reference_every_n_steps=2),
        InjectInf("net.3.weight", steps={2}),
    ]
    trainer = quiet_trainer(
        max_steps=6,
        plugins=[MPTPrecision("fp16")],
        callbacks=callbacks,
        logger=L.pytorch.loggers.TensorBoardLogger(root, name="demo"),
        log_every_n_steps=2,
    )
    trainer.fit(TinyMLP(), regression_data())
    return root


@pytest.mark.parametrize(("module", "code"), list(docstring_examples()))
def test_docstring_example_runs(module, code, tmp_path, monkeypatch, runs_dir):
    if not NEEDS["lightning_mpt.core.masters.sharded"] and ("fully_shard" in code or "mp_policy" in code):
        pytest.skip("FSDP2 (torch.distributed.fsdp.fully_shard) is public from torch 2.6")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").symlink_to(runs_dir, target_is_directory=True)
    exec(compile(code, f"<docstring of {module.__name__}>", "exec"), dict(vars(module)))  # noqa: S102  (the docstring examples are the test)
