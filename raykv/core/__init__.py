"""Block hashes, offload keys, the GPU block pool, KV groups and request state (plain Python)."""
