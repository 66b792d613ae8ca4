"""The step loop in one process: request scheduling, the connector, an in-process worker group."""
