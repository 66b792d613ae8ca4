"""A replica whose engine loop ends on an error (issue 28, finding 1): its streams end in a 503
that says nothing internal, ``/health`` stops answering 200, Serve replaces the replica, and a
normal request is answered again. The error is forced with the ``fail-scheduler`` fault (the
scheduler's step 40 raises, as a bug in the engine would): no request can do it any more."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx2")  # the HTTP client the openai package brings

from raykv.config import load_config  # noqa: E402

PORT = 8127
FAILING_STEP = 40
REPLACED_S = 180.0
INTERNAL = re.compile(r"Traceback|File \"|\.py\b|/work/|/tmp/|pid=|ip=|Actor|SchedulerFault")


@pytest.fixture(scope="module")
def server(ray_session, tiny_chat_model: Path, tmp_path_factory: pytest.TempPathFactory):
    from raykv.serve.app import ServeOptions, Server

    cfg = load_config(
        None,
        [
            f"model.path={tiny_chat_model}",
            "model.dtype=float32",
            "cache.num_gpu_blocks=96",
            f"offload.shared_pool_dir={tmp_path_factory.mktemp('shards')}",
            f"faults=[fail-scheduler:step={FAILING_STEP}]",
        ],
    )
    srv = Server(cfg, ServeOptions(port=PORT, replicas=1)).start()
    yield srv
    srv.stop()


def test_issue28_1_a_dead_engine_loop_fails_its_streams_and_the_replica_is_replaced(
    server,
) -> None:
    from ray import serve

    from raykv.serve.app import APP_NAME, ENGINE_DEPLOYMENT

    with httpx.Client(base_url=server.url, timeout=120) as http:
        assert http.get("/health").status_code == 200
        # greedy: a sampled end of text would end it before the step that fails
        body = {"prompt": "Count slowly:", "max_tokens": 500, "stream": True, "temperature": 0}
        events = []
        with http.stream("POST", "/v1/completions", json=body) as stream:
            assert stream.status_code == 200  # it started before the step that fails
            events = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
        error = json.loads(events[-1])["error"]
        assert error["type"] == "service_unavailable" and "replaced" in error["message"]
        assert not INTERNAL.search(events[-1]), events[-1]
        # health tells the truth: not 200 while no engine serves
        health = http.get("/health")
        assert health.status_code == 503 and not INTERNAL.search(health.text), health.text
        deadline = time.monotonic() + REPLACED_S
        while True:
            status = serve.status().applications[APP_NAME].deployments[ENGINE_DEPLOYMENT]
            if http.get("/health").status_code == 200:
                break
            assert time.monotonic() < deadline, f"the replica was not replaced: {status}"
            time.sleep(1)
        # the new replica serves (a short request, well before its own step 40)
        out = http.post(
            "/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "temperature": 0}
        )
        assert out.status_code == 200, out.text
        assert out.json()["usage"]["completion_tokens"] == 3
