"""The configuration reference, ``docs/configuration.md``, is what the pydantic models say
(issue 29): a key whose description, type or default changes without regenerating it fails
here. Regenerate with ``python scripts/config_reference.py``."""

from __future__ import annotations

from pathlib import Path

from raykv.config import RaykvConfig
from raykv.config.reference import render, sections

REFERENCE = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def test_the_reference_is_generated_from_the_models_as_they_are() -> None:
    assert REFERENCE.read_text() == render(), "run python scripts/config_reference.py"


def test_every_key_of_the_config_is_in_the_reference_with_a_description() -> None:
    text = REFERENCE.read_text()
    keys = [key for _, _, fields in sections(RaykvConfig) for key, _ in fields]
    assert len(keys) > 60
    for _, _, fields in sections(RaykvConfig):
        for key, info in fields:
            assert f"| `{key}` |" in text, key
            assert info.description, f"{key} has no description"
