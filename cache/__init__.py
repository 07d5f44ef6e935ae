"""dflash.cache: prefix snapshots, L1/L2 tiers and sparse-prefill position lists."""
