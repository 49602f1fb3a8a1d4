"""The diagnostics of the numerics, framework-free: torch, torchmetrics and TensorBoard, nothing from Lightning.

Both front-ends drive them: the Trainer callbacks (:mod:`lightning_mpt.callbacks`) and Fabric's
:class:`~lightning_mpt.fabric.MixedPrecisionLogger` make a :class:`~lightning_mpt.diagnostics.session.DiagnosticSession`
and call the statistic sets on it (:mod:`~lightning_mpt.diagnostics.loss_scale`,
:mod:`~lightning_mpt.diagnostics.underflow`, :mod:`~lightning_mpt.diagnostics.histograms`); ``lightning-mpt report``
reads what they wrote with the same :mod:`~lightning_mpt.diagnostics.tags`.
"""
