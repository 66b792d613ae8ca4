"""Benchmarks behind ``raykv bench``."""
