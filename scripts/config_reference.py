#!/usr/bin/env python3
"""Write the configuration reference, ``docs/configuration.md``, from the pydantic models
(``raykv/config/reference.py``); ``--check`` only says whether the file is current (exit 1 if not).

Usage: python scripts/config_reference.py [--check]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from raykv.config.reference import render

TARGET = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = TARGET.read_text() if TARGET.exists() else ""
        if current != text:
            print(
                f"{TARGET} is out of date: run python scripts/config_reference.py", file=sys.stderr
            )
            return 1
        return 0
    TARGET.write_text(text)
    print(f"wrote {TARGET}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
