"""How many scheduler deaths the client survives: it redeploys at most
``MAX_SCHEDULER_RESTARTS`` (3) times; the next death ends the run with the last error."""

from __future__ import annotations

import pytest

from raykv.cluster.client import MAX_SCHEDULER_RESTARTS, RaykvClient
from raykv.config import load_config


def test_the_client_redeploys_at_most_three_times_and_gives_up_at_the_fourth_death(
    monkeypatch,
) -> None:
    deploys: list[int] = []
    client = RaykvClient(load_config(None, []), ray_handle=None, pg=None, actor_options={})
    monkeypatch.setattr(client, "_teardown_actors", lambda: None)
    monkeypatch.setattr(client, "_deploy", lambda: deploys.append(client.scheduler_restarts))
    assert MAX_SCHEDULER_RESTARTS == 3
    for death in range(1, 4):
        client._replace_deployment(RuntimeError(f"death {death}"))
        assert client.scheduler_restarts == death
    assert deploys == [1, 2, 3]
    with pytest.raises(RuntimeError, match=r"died 4 times; last: death 4") as info:
        client._replace_deployment(RuntimeError("death 4"))
    assert str(info.value.__cause__) == "death 4"
    assert deploys == [1, 2, 3]  # no fourth deployment
