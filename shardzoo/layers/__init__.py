"""Parallel layers. Every sharded parameter carries a ShardSpec (see shard_spec.py)."""

from shardzoo.layers.shard_spec import ShardSpec, full_state_dict, gather_full, get_shard_spec, set_shard_spec

__all__ = ["ShardSpec", "full_state_dict", "gather_full", "get_shard_spec", "set_shard_spec"]
