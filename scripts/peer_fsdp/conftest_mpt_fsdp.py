"""pytest plugin: run Lightning's own ``ModelParallelStrategy`` tests with ``MPTPrecision`` substituted.

The FSDP2 counterpart of /work/shared/peer (``conftest_mpt.py``), which substitutes only on one device and DDP.
Load it with ``-p conftest_mpt_fsdp`` (this folder on PYTHONPATH) from a Lightning checkout (tag 2.6.5 matches the
installed lightning 2.6.6); no Lightning test code is copied. Two substitution points, nothing else is touched:

* every ``ModelParallelStrategy`` built without a precision plugin gets ``MPTPrecision(MPT_FSDP_DTYPE)`` (the unit
  tests build the strategy directly and call ``strategy.setup``);
* ``_AcceleratorConnector._check_and_init_precision``: a Trainer with a ``ModelParallelStrategy`` and the default,
  ``"bf16-mixed"`` or ``"16-mixed"`` precision gets ``MPTPrecision`` too.

Environment: ``MPT_FSDP_DTYPE`` ("bf16" default, or "fp16"); ``MPT_FSDP_TARGET`` ("mpt" default, or "lightning" for
the baseline: no substitution); ``MPT_FSDP_LOG``: a JSONL file, one line per test with its outcome and the
substitutions made (a test that passes without one did not exercise the plugin).

    cd /tmp/lightning-tests && PYTHONPATH=$REPO:$REPO/scripts/peer_fsdp MPT_FSDP_LOG=/tmp/fsdp.jsonl \\
        python -m pytest -p conftest_mpt_fsdp -p no:cacheprovider \\
        tests/tests_pytorch/strategies/test_model_parallel.py \\
        tests/tests_pytorch/strategies/test_model_parallel_integration.py
"""

from __future__ import annotations

import json
import os

import pytest

_STATE: dict = {"subs": [], "undo": []}


def _plugin():
    from lightning_mpt import MPTPrecision

    return MPTPrecision(os.environ.get("MPT_FSDP_DTYPE", "bf16"))


def pytest_configure(config):
    if not config.pluginmanager.hasplugin("rerunfailures"):
        config.addinivalue_line("markers", "flaky(reruns=1): rerun marker of pytest-rerunfailures (not installed)")
    if os.environ.get("MPT_FSDP_TARGET", "mpt") != "mpt":
        return
    from lightning.pytorch.strategies import ModelParallelStrategy
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    init = ModelParallelStrategy.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if self._precision_plugin is None:
            self.precision_plugin = _plugin()
            _STATE["subs"].append("strategy->MPTPrecision")

    check = _AcceleratorConnector._check_and_init_precision

    def _check_and_init_precision(self):
        from lightning.pytorch.plugins.precision import Precision

        if isinstance(self._precision_plugin_flag, Precision) or not isinstance(self.strategy, ModelParallelStrategy):
            return check(self)
        if self._precision_flag not in ("32-true", "bf16-mixed", "16-mixed"):
            return check(self)
        _STATE["subs"].append(f"trainer:{self._precision_flag}->MPTPrecision")
        return _plugin()

    ModelParallelStrategy.__init__ = __init__
    _AcceleratorConnector._check_and_init_precision = _check_and_init_precision
    _STATE["undo"] = [
        (ModelParallelStrategy, "__init__", init),
        (_AcceleratorConnector, "_check_and_init_precision", check),
    ]


def pytest_unconfigure(config):
    for owner, name, value in _STATE["undo"]:
        setattr(owner, name, value)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _STATE["subs"] = []


def pytest_runtest_logreport(report):
    path = os.environ.get("MPT_FSDP_LOG")
    decisive = report.when == "call" or (report.when == "setup" and not report.passed)
    if not path or not decisive:
        return
    line = {"nodeid": report.nodeid, "outcome": report.outcome, "substitutions": list(_STATE["subs"])}
    if report.failed:
        line["error"] = (report.longreprtext or "").strip().splitlines()[-1][:300]
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(line) + "\n")
