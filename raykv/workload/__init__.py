"""Workloads: request traces and synthetic generators."""
