"""The diagnostics of the numerics, framework-free (torch, torchmetrics and TensorBoard; nothing from Lightning's
Trainer or Fabric): the statistics, the recorder that reads them out in one host sync, the sink that writes them, and
the TensorBoard tags. The Trainer callbacks (:mod:`lightning_mpt.callbacks`), Fabric's
:class:`~lightning_mpt.fabric.MixedPrecisionLogger` and the report (:mod:`lightning_mpt.report`) build on them."""
