"""Tensors and copies: the KV layout, the CPU pool, transfer engines and the synthetic model.

The only package besides ``bench`` that imports torch; nothing here imports ray. This package
module imports nothing: import from the defining modules (``raykv.transfer.layout``, ...).
"""
