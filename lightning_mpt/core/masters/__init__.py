"""The fp32 master weights of a half-precision model: an fp32 copy of each half parameter
(:mod:`~lightning_mpt.core.masters.copies`, one device and DDP), or FSDP2's own fp32 shards
(:mod:`~lightning_mpt.core.masters.sharded`, torch >= 2.6; imported on demand)."""
