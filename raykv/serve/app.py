"""``raykv serve``: the Serve application (the HTTP ingress and N engine replicas, each with its
ranks in a placement group of its own), started on an embedded Ray or a joined cluster, served
until interrupted, and torn down leaving no Ray process and no shard file behind.
"""

from __future__ import annotations

import contextlib
import ipaddress
import signal
import threading
from dataclasses import dataclass, field
from typing import Any

from raykv.config import ConfigError, RaykvConfig, ServeConfig
from raykv.serve.kv_index import KVLayout
from raykv.serve.tenants import api_keys

APP_NAME = "raykv"
ENGINE_DEPLOYMENT = "raykv-engine"
INGRESS_DEPLOYMENT = "raykv-ingress"

# request routers by name: raykv's KV-aware one, and as the baselines Serve's default (power
# of two choices) and Ray Serve LLM's text prefix tree
ROUTERS = {
    "kv": "raykv.serve.kv_router:KVAwareRouter",
    "pow2": "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter",
    "prefix": (
        "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router:"
        "PrefixCacheAffinityRouter"
    ),
}

# requests a replica takes at once: its engine batches them (Serve's default of 5 would starve
# the batch)
MAX_ONGOING_PER_REPLICA = 64
MAX_ONGOING_INGRESS = 1024
# what a replica's stop takes besides its spill: the drain of what is in flight (the engine
# actor's DRAIN_S, 30 s), its loop's end and its ranks' shutdown (their I/O threads, 30 s)
STOP_MARGIN_S = 90.0


@dataclass(slots=True)
class ServeOptions:
    """How to serve: where to listen, how many replicas, which router (None: ``kv`` with more
    than one replica, else ``pow2``), the API key."""

    host: str = "127.0.0.1"
    port: int = 8000
    replicas: int = 1
    replica_resources: dict[str, float] = field(default_factory=dict)
    router: str | None = None
    api_key: str | None = None  # one key, or several separated by commas (one tenant each)
    insecure: bool = False
    cache_isolation: str = "per_key"

    @classmethod
    def of(cls, serve: ServeConfig, api_key: str | None = None, **flags: Any) -> ServeOptions:
        """The config's ``serve:`` section, with the flags given (not None) over it."""
        values = {
            "host": serve.host,
            "port": serve.port,
            "replicas": serve.replicas,
            "replica_resources": dict(serve.replica_resources),
            "router": serve.router,
            "insecure": serve.insecure,
            "cache_isolation": serve.cache_isolation,
        }
        values.update({k: v for k, v in flags.items() if v is not None and v is not False})
        return cls(api_key=api_key, **values)

    @property
    def router_name(self) -> str:
        if self.router is not None:
            return self.router
        return "kv" if self.replicas > 1 else "pow2"

    def check(self) -> None:
        """ConfigError naming the option at fault."""
        if self.replicas < 1:
            raise ConfigError(f"--replicas {self.replicas}: must be at least 1")
        if self.router is not None and self.router not in ROUTERS:
            raise ConfigError(f"--router {self.router!r}: expected one of {', '.join(ROUTERS)}")
        if not 0 < self.port < 65536:
            raise ConfigError(f"--port {self.port}: not a port number")
        if self.api_key is not None and not api_keys(self.api_key):
            raise ConfigError("--api-key: no key given (RAYKV_API_KEY or --api-key is empty)")
        if not _loopback(self.host) and not self.api_key and not self.insecure:
            raise ConfigError(
                f"--host {self.host}: serving beyond this machine needs --api-key KEY "
                "(or RAYKV_API_KEY), or --insecure to serve without one"
            )


def check_router(cfg: RaykvConfig, options: ServeOptions) -> None:
    """ConfigError where the router cannot work with ``cfg``: the kv router mirrors what each
    replica holds from its KV events alone, and without them would route as if nothing were
    cached, for ever."""
    if options.router_name == "kv" and not cfg.offload.events:
        raise ConfigError(
            "offload.events: false, but the kv router follows the replicas' KV events; "
            "set offload.events=true or choose --router pow2"
        )


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def served_config(cfg: RaykvConfig) -> tuple[RaykvConfig, str]:
    """``cfg`` with the checkpoint's geometry and the tokenizer's EOS (what every replica runs),
    and the model's file."""
    from raykv.model.checkpoint import configure, with_stop_tokens
    from raykv.model.tokenizer import Tokenizer

    cfg, _, path = configure(cfg)
    tokenizer = Tokenizer.of(path, cfg.model.cache_dir)
    if tokenizer is not None:
        cfg = with_stop_tokens(cfg, [tokenizer.eos_token_id])
    # a server runs for days: finished requests are forgotten (their outputs went out)
    cfg = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"keep_finished": False})})
    return cfg, str(path)


def model_name(cfg: RaykvConfig) -> str:
    """The name ``/v1/models`` gives: the preset's, or the checkpoint's file or directory."""
    from pathlib import Path

    path = str(cfg.model.path)
    return Path(path).stem if ("/" in path or path.endswith(".gguf")) else path


def build_app(cfg: RaykvConfig, model_file: str, options: ServeOptions) -> Any:
    """The Serve application for ``cfg`` (configured by ``served_config``) and the model's
    file (its tokenizer's source)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from raykv.cluster.rank_actor import rank_bundle
    from raykv.serve.ingress import ingress_deployment
    from raykv.serve.replica import EngineReplica

    tp = cfg.parallel.tensor_parallel_size
    engine = serve.deployment(EngineReplica).options(
        name=ENGINE_DEPLOYMENT,
        num_replicas=options.replicas,
        ray_actor_options={"num_cpus": 1},
        # the replica first, then its ranks: one TP group, one node
        placement_group_bundles=[{"CPU": 1.0, **options.replica_resources}]
        + [rank_bundle(cfg) for _ in range(tp)],
        placement_group_strategy="STRICT_PACK",
        max_ongoing_requests=MAX_ONGOING_PER_REPLICA,
        request_router_config=RequestRouterConfig(
            request_router_class=ROUTERS[options.router_name],
            request_router_kwargs=router_kwargs(cfg, options.router_name),
        ),
        health_check_period_s=2,
        health_check_timeout_s=30,
        # a replica's stop drains what is in flight, spills its CPU tier to the disk tier
        # (offload.disk.spill_on_stop_s) and then stops its loop and ranks: Serve waits that
        # long for it (20 s by default)
        graceful_shutdown_timeout_s=STOP_MARGIN_S + cfg.offload.disk.spill_on_stop_s,
    )
    ingress = ingress_deployment().options(
        name=INGRESS_DEPLOYMENT,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=MAX_ONGOING_INGRESS,
    )
    limits = {
        "max_positions": cfg.model.max_positions,
        "vocab_size": cfg.model.vocab_size,
        "max_request_bytes": cfg.serve.max_request_bytes,
    }
    return ingress.bind(
        engine.bind(cfg.model_dump(mode="json"), model_file),
        model_name(cfg),
        model_file,
        options.api_key,
        options.router_name == "prefix",
        cfg.model.cache_dir,
        limits,
        options.cache_isolation,
    )


def kv_layout(cfg: RaykvConfig) -> KVLayout:
    """How the engine of ``cfg`` turns a prompt into KV keys (what a router hashes)."""
    groups = [i for i, g in enumerate(cfg.cache.groups) if g.kind == "full_attention"]
    return KVLayout(
        cfg.cache.block_size,
        cfg.offload.blocks_per_chunk if cfg.offload.enabled else 1,
        tuple(groups or [0]),
    )


def router_kwargs(cfg: RaykvConfig, router: str) -> dict[str, Any]:
    """What the KV-aware router needs to hash prompts as the engine does, its weights, and
    the engine's step token budget."""
    if router != "kv":
        return {}
    layout = kv_layout(cfg)
    return {
        "block_size": layout.block_size,
        "blocks_per_chunk": layout.blocks_per_chunk,
        "groups": list(layout.groups),
        "weights": cfg.serve.router_weights.model_dump(),
        "step_tokens": cfg.engine.max_num_batched_tokens,
    }


def ray_resources(cfg: RaykvConfig, replicas: int) -> tuple[int, int | None]:
    """CPUs and GPUs an embedded Ray needs for ``replicas``: one CPU per replica, its ranks'
    (a CPU or a GPU each), and one for the ingress and Serve."""
    tp = cfg.parallel.tensor_parallel_size
    cuda = cfg.parallel.device == "cuda"
    return replicas * (1 + (0 if cuda else tp)) + 1, (replicas * tp if cuda else None)


class Server:
    """A running ``raykv serve``: ``start`` deploys and returns once every replica is up;
    ``url``; ``stop`` tears it all down."""

    def __init__(self, cfg: RaykvConfig, options: ServeOptions, address: str | None = None):
        options.check()
        check_router(cfg, options)
        self.cfg, self.model_file = served_config(cfg)
        self.options = options
        self.address = address
        self._ray: Any = None

    @property
    def url(self) -> str:
        host = self.options.host
        return f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{self.options.port}"

    def start(self) -> Server:
        from ray import serve
        from ray.serve.config import HTTPOptions

        from raykv.cluster.runtime import connect

        cpus, gpus = ray_resources(self.cfg, self.options.replicas)
        self._ray = connect(self.address, num_cpus=cpus, num_gpus=gpus)
        try:
            serve.start(http_options=HTTPOptions(host=self.options.host, port=self.options.port))
            serve.run(
                build_app(self.cfg, self.model_file, self.options), name=APP_NAME, route_prefix="/"
            )
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Every replica (its ranks and shard files with it), Serve, and Ray if raykv started
        it."""
        from ray import serve

        with contextlib.suppress(Exception):
            serve.delete(APP_NAME)
        with contextlib.suppress(Exception):
            serve.shutdown()
        if self._ray is not None:
            self._ray.shutdown()
            self._ray = None

    def wait(self) -> None:
        """Block until SIGINT or SIGTERM."""
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
