"""The configuration reference (``docs/configuration.md``), rendered from the pydantic models
themselves: every key path with its type, default and description, so the reference cannot
drift from the code. ``scripts/config_reference.py`` writes it; a test checks it is current."""

from __future__ import annotations

import types
import typing
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from raykv.config import RaykvConfig

HEADER = """# Configuration reference

Every key of a raykv YAML config (or of `--set KEY.PATH=VALUE`), by section. Generated from the
pydantic models in `raykv/config/` by `python scripts/config_reference.py`; a test fails when
this file and the models disagree. Sizes take bytes or a number with a unit (`512MiB`, `2GiB`,
`1.5GB`); unknown keys are errors naming their path.
"""


def type_name(annotation: Any) -> str:
    """A field's type as the reference shows it (``int | None``, ``fcfs, shortest-prefill``)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return type_name(typing.get_args(annotation)[0])
    if origin is Literal:
        return " \\| ".join(f"`{value}`" for value in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(type_name(arg) for arg in typing.get_args(annotation))
    if origin in (list, dict, tuple):
        inner = ", ".join(type_name(arg) for arg in typing.get_args(annotation))
        return f"{origin.__name__}[{inner}]"
    if annotation is type(None):
        return "None"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    return getattr(annotation, "__name__", str(annotation))


def default_text(info: FieldInfo) -> str:
    """A field's default; one computed when the config is built (from the environment) says
    so rather than show this machine's value."""
    if info.default_factory is not None:
        made = info.default_factory()  # type: ignore[call-arg]
        return f"`{made!r}`" if made in ([], {}) else "(set when loaded; see the description)"
    if info.is_required():
        return "(required)"
    value = info.default
    if isinstance(value, BaseModel):
        return "(section)"
    if value is None:
        return "none"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The section model a field holds, directly or as a list of them."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) is list:
        (inner,) = typing.get_args(annotation)
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            return inner
    return None


def sections(
    model: type[BaseModel] = RaykvConfig, prefix: str = ""
) -> Iterator[tuple[str, type[BaseModel], list[tuple[str, FieldInfo]]]]:
    """(section path, its model, its plain fields) for every section, depth first."""
    plain = []
    nested = []
    for name, info in model.model_fields.items():
        inner = _model_of(info.annotation)
        path = f"{prefix}{name}"
        if inner is None:
            plain.append((path, info))
        else:
            many = typing.get_origin(info.annotation) is list
            nested.append((f"{path}[]" if many else path, inner))
    if plain:
        yield prefix.rstrip(".") or "(top level)", model, plain
    for path, inner in nested:
        yield from sections(inner, f"{path}.")


def render() -> str:
    """The whole reference, as ``docs/configuration.md`` holds it."""
    lines = [HEADER]
    for path, model, fields in sections():
        lines.append(f"## `{path}`\n")
        doc = " ".join((model.__doc__ or "").split())
        if doc:
            lines.append(f"{doc}\n")
        lines.append("| key | type | default | description |")
        lines.append("|---|---|---|---|")
        for key, info in fields:
            description = " ".join((info.description or "").split()).replace("|", "\\|")
            lines.append(
                f"| `{key}` | {type_name(info.annotation)} | {default_text(info)} | {description} |"
            )
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"
