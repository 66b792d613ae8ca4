"""raykv: a Ray-native KV-cache offloading engine for multi-GPU LLM serving."""

__version__ = "0.1.0"
