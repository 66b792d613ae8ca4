"""The package's face: ``import raykv`` stays light, and every name it offers resolves."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import raykv

ROOT = Path(__file__).resolve().parents[1]


def test_import_raykv_imports_neither_ray_nor_torch() -> None:
    code = "import raykv, sys; assert 'ray' not in sys.modules and 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


def test_the_processes_that_hold_no_kv_import_no_torch() -> None:
    """The scheduler actor's process, a served replica and its ingress load no torch (seconds of
    every start, on every replica): torch is the ranks' (their tensors) and the model's."""
    modules = ["raykv.cluster.engine_actor", "raykv.engine.core", "raykv.serve.replica"]
    modules += ["raykv.serve.ingress", "raykv.model.tokenizer"]
    code = f"import sys, {', '.join(modules)}; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


def test_every_exported_name_resolves() -> None:
    from raykv.cluster.client import RaykvClient
    from raykv.config import load_config
    from raykv.workload.requests import RequestSpec

    assert raykv.RaykvClient is RaykvClient
    assert raykv.load_config is load_config
    assert raykv.RequestSpec is RequestSpec
    assert raykv.__version__
    for name in raykv.__all__:
        assert getattr(raykv, name) is not None
