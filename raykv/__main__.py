"""``python -m raykv``: the ``raykv`` command, for a machine where the package is on the path
but not installed (a GPU node running a checkout)."""

from raykv.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
