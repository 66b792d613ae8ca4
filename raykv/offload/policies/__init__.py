"""Eviction policies, pluggable by name.

Built-in names are registered here. A policy outside raykv is loaded only from an explicit import
path (``package.module:ClassName``) given in the config; nothing is imported implicitly.
"""

from __future__ import annotations

import importlib

from raykv.offload.policies.arc import ARCPolicy
from raykv.offload.policies.base import CachePolicy
from raykv.offload.policies.lru import LRUPolicy
from raykv.offload.policies.recall import RecallPolicy

_REGISTRY: dict[str, type[CachePolicy]] = {}


def register_policy(cls: type[CachePolicy]) -> type[CachePolicy]:
    """Register a policy class under its ``name`` (usable as a decorator)."""
    if not cls.name:
        raise ValueError(f"{cls.__qualname__} has no name")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"a policy named {cls.name!r} is already registered")
    _REGISTRY[cls.name] = cls
    return cls


def policy_names() -> list[str]:
    """Every registered policy name, in registration order."""
    return list(_REGISTRY)


def resolve_policy(spec: str) -> type[CachePolicy]:
    """A registered name, or ``module:Class`` for a policy outside raykv."""
    if ":" in spec:
        module_name, _, attr = spec.partition(":")
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"cannot load policy {spec!r}: {exc}") from exc
        if not (isinstance(cls, type) and issubclass(cls, CachePolicy)):
            raise ValueError(f"policy {spec!r} is not a CachePolicy subclass")
        return cls
    try:
        return _REGISTRY[spec]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY))
        raise ValueError(f"unknown policy {spec!r} (known: {known})") from None


def make_policy(spec: str, capacity: int) -> CachePolicy:
    """Instantiate a policy by name or import path for a directory of ``capacity`` slots."""
    return resolve_policy(spec)(capacity)


register_policy(LRUPolicy)
register_policy(ARCPolicy)
register_policy(RecallPolicy)

__all__ = [
    "ARCPolicy",
    "CachePolicy",
    "LRUPolicy",
    "RecallPolicy",
    "make_policy",
    "policy_names",
    "register_policy",
    "resolve_policy",
]
