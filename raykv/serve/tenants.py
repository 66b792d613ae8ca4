"""Who may call the server and whose cache a request may hit: the API keys, one tenant per key,
and the salt a request's blocks are hashed under (``core/hashing.py``).

``serve.cache_isolation``: ``per_key`` (the default) hashes every request under its key's
tenant and, within it, its own ``cache_salt``; ``request_salt`` only under its ``cache_salt``
(one tenant for every key); ``required`` as ``per_key``, and a request without ``cache_salt``
is refused. A tenant is named by a hash of its key, so no key reaches a replica, its reports or
its logs. Plain Python: the ingress and ``raykv serve``'s checks both use it.
"""

from __future__ import annotations

import hashlib

ISOLATIONS = ("per_key", "request_salt", "required")


def api_keys(given: str | None) -> list[str]:
    """The API keys ``--api-key`` or RAYKV_API_KEY give: one, or several separated by commas
    (each its own tenant where caches are isolated per key)."""
    return [key.strip() for key in (given or "").split(",") if key.strip()]


def tenant_tag(key: str) -> str:
    """A tenant's name from its API key: a hash, so that no key travels past the ingress."""
    return hashlib.blake2b(key.encode(), digest_size=12, person=b"raykv-tenant").hexdigest()


class SaltRequired(ValueError):
    """The server requires a ``cache_salt`` and the request gave none."""


def request_salt(isolation: str, tenant: str | None, given: str | None) -> str | None:
    """The salt a request's blocks are hashed under (None: none, the shared cache): its
    tenant's (where caches are isolated per key and the server has keys) and its own
    ``cache_salt``; ``SaltRequired`` where one is required and none was given."""
    if given is None and isolation == "required":
        raise SaltRequired("cache_salt is required by this server")
    if isolation == "request_salt" or tenant is None:
        return given
    if given is None:
        return f"tenant:{tenant}"
    # the request's salt hashed: the whole stays as short as any salt the API takes
    digest = hashlib.blake2b(given.encode("utf-8", "surrogatepass"), digest_size=16)
    return f"tenant:{tenant}|salt:{digest.hexdigest()}"
