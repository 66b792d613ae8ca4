"""The client API: start a deployment, run or serve requests, stream outputs and KV events."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group

from raykv.cluster.actors import READY_TIMEOUT_S, EngineServer, spawn_rank_worker
from raykv.cluster.runtime import RayHandle, connect
from raykv.config import RaykvConfig
from raykv.pool_files import PoolFiles, sweep_stale
from raykv.workload.requests import RequestSpec


class DeploymentError(RuntimeError):
    """The deployment could not start (no resources, an actor failed to come up)."""


class RaykvClient:
    """A running raykv deployment: one worker actor per rank in a placement group (packed on one
    node by default), and one scheduler actor.

    ``RaykvClient.start(cfg)`` starts (or joins) Ray and the actors; ``run(specs)`` replays a
    workload and returns the report; ``submit`` + ``stream`` serve requests as they come;
    ``events`` returns the CPU tier's KV events; ``shutdown`` tears everything down.
    """

    def __init__(
        self,
        cfg: RaykvConfig,
        ray_handle: RayHandle,
        pg: Any,
        workers: list[Any],
        server: Any,
        pool_files: PoolFiles | None = None,
    ) -> None:
        self.cfg = cfg
        self._pool_files = pool_files
        self._ray = ray_handle
        self._pg = pg
        self.workers = workers
        self.server = server
        self._serving = False

    @classmethod
    def start(
        cls,
        cfg: RaykvConfig,
        *,
        address: str | None = None,
        verify: bool | None = None,
        check_invariants: bool = False,
        offload: bool | None = None,
    ) -> RaykvClient:
        tp = cfg.parallel.tensor_parallel_size
        cuda = cfg.parallel.device == "cuda"
        handle = connect(address, num_cpus=max(tp, 1) if not cuda else 1)
        bundle = {"GPU": 1.0} if cuda else {"CPU": 1.0}
        pg = placement_group([dict(bundle) for _ in range(tp)], cfg.parallel.placement_strategy)
        try:
            ray.get(pg.ready(), timeout=READY_TIMEOUT_S)
        except Exception as exc:
            remove_placement_group(pg)
            handle.shutdown()
            raise DeploymentError(
                f"cannot place {tp} ranks needing {bundle} each with "
                f"{cfg.parallel.placement_strategy} (cluster has {ray.cluster_resources()}): {exc}"
            ) from exc
        cfg_json = cfg.model_dump(mode="json")
        files = None
        if cfg.offload.shared_pool and cfg.offload.enabled and offload is not False:
            sweep_stale(cfg.offload.shared_pool_dir)
            files = PoolFiles.new(cfg.offload.shared_pool_dir)
        workers = [
            spawn_rank_worker(cfg_json, i, 0, pg, files.path(i) if files else None)
            for i in range(tp)
        ]
        server_cls = ray.remote(EngineServer)
        server = server_cls.options(num_cpus=0, max_concurrency=8).remote(
            cfg_json, workers, verify, check_invariants, offload, pg
        )
        client = cls(cfg, handle, pg, workers, server, files)
        try:
            ray.get(
                [w.ready.remote() for w in workers] + [server.ping.remote()],
                timeout=READY_TIMEOUT_S,
            )
        except Exception as exc:
            client.shutdown()
            raise DeploymentError(f"raykv actors failed to start: {exc}") from exc
        return client

    # ---- batch ----------------------------------------------------------------------------

    def run(
        self,
        specs: Sequence[RequestSpec],
        progress: Callable[[dict[str, Any]], None] | None = None,
        poll_s: float = 0.25,
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        """Run ``specs`` to the end on the deployment; returns the run report."""
        ref = self.server.run.remote(list(specs))
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            ready, _ = ray.wait([ref], timeout=poll_s)
            if progress is not None:
                progress(ray.get(self.server.progress.remote(), timeout=60))
            if ready:
                break
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"run still going after {timeout_s} s")
        report = ray.get(ref)
        report["ranks_detail"] = self.rank_report(report)
        return report

    def rank_report(self, report: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"rank": i, **stats} for i, stats in enumerate(report.get("ranks", []))]

    # ---- serving ----------------------------------------------------------------------------

    def submit(self, specs: Sequence[RequestSpec]) -> None:
        """Queue requests; they are served as they arrive (``arrival`` 0 means now)."""
        if not self._serving:
            ray.get(self.server.start.remote())
            self._serving = True
        ray.get(self.server.submit.remote(list(specs)))

    def stream(
        self, timeout_s: float = 600.0, poll_s: float = 0.05
    ) -> Iterator[tuple[str, list[int], str]]:
        """Yield (request id, generated tokens, status) as requests finish, until every submitted
        request has finished and every transfer is acked."""
        deadline = time.monotonic() + timeout_s
        while True:
            for item in ray.get(self.server.take_finished.remote()):
                yield item
            progress = ray.get(self.server.progress.remote())
            if progress["error"]:
                raise RuntimeError(f"the engine stopped: {progress['error']}")
            if ray.get(self.server.idle.remote()):
                for item in ray.get(self.server.take_finished.remote()):
                    yield item
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"requests still running after {timeout_s} s")
            time.sleep(poll_s)

    def events(self) -> list[Any]:
        """The CPU tier's KV events since the last call (BlockStored / BlockRemoved)."""
        return ray.get(self.server.take_events.remote())

    def progress(self) -> dict[str, Any]:
        return ray.get(self.server.progress.remote())

    def report(self) -> dict[str, Any]:
        return ray.get(self.server.report.remote())

    # ---- test hooks -------------------------------------------------------------------------

    def hold_acks(self, rank: int, steps: int, every: int = 1, offset: int = 0) -> None:
        """Make ``rank`` report every ``every``-th job's completion ``steps`` steps late."""
        ray.get(self.workers[rank].hold_acks.remote(steps, every, offset))

    # ---- teardown ---------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the loop, the actors and the placement group; stop Ray if raykv started it."""
        with contextlib.suppress(Exception):  # an actor already gone must not keep the rest alive
            if self._serving:
                ray.get(self.server.stop.remote(), timeout=60)
            self.workers = ray.get(self.server.workers.remote(), timeout=60)
            ray.get([w.shutdown.remote() for w in self.workers], timeout=60)
        for actor in [self.server, *self.workers]:
            with contextlib.suppress(Exception):
                ray.kill(actor)
        with contextlib.suppress(Exception):
            remove_placement_group(self._pg)
        if self._pool_files is not None:  # shards of ranks that died without cleaning up
            self._pool_files.remove()
        self._ray.shutdown()

    def __enter__(self) -> RaykvClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
