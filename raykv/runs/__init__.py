"""Driving a workload through an engine and reporting on it: the driver (arrivals, steps, the
output digest), the typed run report and its terminal rendering, ``raykv generate``'s prompts
and outputs, and a chat session's turns. The engine itself (``raykv/engine/``) knows none of
this."""
