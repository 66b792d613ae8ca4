"""The ``raykv`` command, one module per subcommand group (``main`` builds the parser from
them): ``run``, ``generate``, ``serve``, ``config`` and the benchmarks (``bench_engine``,
``bench_serving``), with what they share in ``common``."""

from raykv.cli.main import main

__all__ = ["main"]
