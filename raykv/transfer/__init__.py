"""Tensors and copies: the KV layout, the CPU pool, transfer engines and the synthetic model.

The only package besides ``bench`` that imports torch; nothing here imports ray.
"""

from raykv.transfer.cpu import CpuTransferEngine, plan_copies
from raykv.transfer.layout import KVLayout, allocate_kv, allocate_pool, pool_rows
from raykv.transfer.model import SyntheticModel, mix64, mix64_tensor

__all__ = [
    "CpuTransferEngine",
    "KVLayout",
    "SyntheticModel",
    "allocate_kv",
    "allocate_pool",
    "mix64",
    "mix64_tensor",
    "plan_copies",
    "pool_rows",
]
