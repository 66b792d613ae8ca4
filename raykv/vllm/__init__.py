"""raykv inside vLLM: its tiers as vLLM's offloading backend (the only package that imports
vllm). vLLM's ``OffloadingConnector`` loads it with ``kv_connector_extra_config={"spec_name":
"RaykvOffloadingSpec", "spec_module_path": "raykv.vllm", "raykv": {...}}``; see docs/vllm.md."""

from __future__ import annotations

from raykv.vllm.versions import check_version

try:
    import vllm
except ImportError as exc:  # said in one line, for whoever named this module to vLLM
    raise ImportError(f"raykv.vllm needs vLLM installed ({exc})") from None

check_version(vllm.__version__)

from raykv.vllm.spec import RaykvOffloadingSpec  # noqa: E402

__all__ = ["RaykvOffloadingSpec"]
