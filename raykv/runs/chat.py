"""Driving a chat session (``workload/chat.py``) on the one-process engine: each answered turn
submits the turns it unblocks, until the session has none left."""

from __future__ import annotations

from raykv.engine.core import EngineCore
from raykv.runs.driver import Driver, Progress, progress_of
from raykv.runs.report import RunReport
from raykv.workload.chat import ChatSession


def run_chat(
    engine: EngineCore, session: ChatSession, progress: Progress | None = None
) -> RunReport:
    """Run the session to its end on ``engine``; the report covers every turn."""
    driver = Driver(engine)
    driver.submit(session.start())
    while driver.has_work():
        driver.step()
        follow = []
        for req in driver.take_finished():
            follow += session.answered(req.req_id, req.output)
        for item in driver.take_rejected():  # a refused turn ends its conversation
            follow += session.answered(item["request"], [])
        driver.submit(follow)
        if progress is not None:
            progress(progress_of(driver))
    return driver.report()
