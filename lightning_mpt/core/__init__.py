"""The mixed-precision step, in torch only (nothing here imports Lightning): the loss scaler, the numerics of the
half formats, the fp32 master weights and the engine that scales, decides, steps or skips, and guards.

Both front-ends (the Trainer plugin, :mod:`lightning_mpt.precision`, and the Fabric plugin,
:mod:`lightning_mpt.fabric`) delegate to :class:`~lightning_mpt.core.engine.MixedPrecisionEngine`.
"""
