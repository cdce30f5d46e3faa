"""``conveyor``: run the whole pipeline in one go (``up``), or each process alone
(docs/operating/processes.md). Every process reads the same settings
(``CONVEYOR_*`` environment variables), so the same commands spread over many
hosts against one Kafka cluster give a multi-node deployment."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import signal
import subprocess
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from cli.text import fail
from conveyor.registry import Registry
from conveyor.settings import ENV_PREFIX, Settings, load_settings
from workers.stages import UnknownStage, stage, stage_names

if TYPE_CHECKING:
    from workers.infer.engines.base import Engine

__all__ = ["main"]

log = logging.getLogger("conveyor")


def _setup_logging(settings: Settings) -> None:
    from conveyor.logs import setup_logging

    setup_logging(settings.telemetry.log_level)


def _run(main: Coroutine[Any, Any, None]) -> None:
    """Run a process's main coroutine on uvloop (installed with uvicorn[standard])."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
    else:
        uvloop.run(main)


def _on_signals(stop: Callable[[], None]) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop)


async def _ensure_topics(settings: Settings, registry: Registry) -> None:
    from topics.admin import ensure_topics
    from topics.catalog import catalog

    await ensure_topics(settings, catalog(settings.kafka, registry.pools()))


async def _redis_answers(settings: Settings) -> None:
    """Wait (logged, bounded) until Redis answers: the gateway leases its reply
    partition there as it starts."""
    from conveyor.redis_clients import REDIS_REFUSALS, redis_client
    from conveyor.startup import redis_address, started

    client = redis_client(settings.redis, "cli")
    try:
        await started("Redis to answer", client.ping, within=settings.process.startup_timeout_s,
                      log=log, where=redis_address(settings.redis.url),
                      retry_on=REDIS_REFUSALS)
    finally:
        await client.aclose()


async def _serving_registry(settings: Settings) -> Registry:
    """The topics made, and the registry a serving process starts with: its file's,
    or the one ``conveyor models apply`` published, if one was."""
    from conveyor.startup import kafka_address, started
    from topics.models import adopt_published

    registry = Registry.load(settings.process.models_file)
    await _ensure_topics(settings, registry)
    await started("the applied model registry (conveyor.models)",
                  lambda: adopt_published(settings, registry), log=log,
                  within=settings.process.startup_timeout_s,
                  where=kafka_address(settings.kafka.bootstrap))
    return registry


async def _gateway_services(settings: Settings) -> Registry:
    registry = await _serving_registry(settings)
    await _redis_answers(settings)
    return registry


# -- subcommands ----------------------------------------------------------------


def cmd_topics(settings: Settings, args: argparse.Namespace) -> int:
    registry = Registry.load(settings.process.models_file)
    asyncio.run(_ensure_topics(settings, registry))
    return 0


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(settings: Settings, insecure_no_auth: bool = False) -> None:
    """Refuse to serve without authentication anywhere but loopback, unless told
    so: nobody should expose an open gateway by accident."""
    if settings.auth.mode != "none" or _loopback(settings.gateway.host):
        return
    if insecure_no_auth or settings.auth.insecure_no_auth:
        log.warning("serving WITHOUT authentication on %s (--insecure-no-auth)",
                    settings.gateway.host)
        return
    raise SystemExit(
        f"conveyor: refusing to bind {settings.gateway.host} without authentication. "
        "Set CONVEYOR_AUTH=keys (or jwt), bind 127.0.0.1, or pass --insecure-no-auth "
        "(CONVEYOR_INSECURE_NO_AUTH=1) if an open gateway is really what you want.")


def cmd_gateway(settings: Settings, args: argparse.Namespace) -> int:
    import uvicorn

    from gateway.app import build_app, check_auth_settings

    check_exposure(settings, args.insecure_no_auth)
    try:
        check_auth_settings(settings)
    except ValueError as exc:
        raise SystemExit(f"conveyor: {exc}") from None
    registry = asyncio.run(_gateway_services(settings))
    from conveyor import heap

    app = build_app(settings, registry,
                    on_ready=lambda: heap.settle(settings.process.gc_threshold, "gateway"))
    uvicorn.run(app, host=settings.gateway.host,
                port=settings.gateway.port, loop="uvloop", http="httptools",
                log_level="warning", access_log=False, timeout_graceful_shutdown=5)
    return 0


async def _run_layers(settings: Settings, names: list[str]) -> None:
    from workers.runtime import LayerRuntime

    registry = await _serving_registry(settings)
    from conveyor.startup import kafka_address, started
    from topics.clients import make_producer

    producer = make_producer(settings.kafka)
    await started("the Kafka producer to connect", producer.start, log=log,
                  within=settings.process.startup_timeout_s,
                  where=kafka_address(settings.kafka.bootstrap))
    from topics.tracing import make_tracer

    tracing = make_tracer(settings.telemetry.trace_exporter, "+".join(names))
    from workers.cancels import CancelList

    cancels = CancelList(settings)  # one follower of conveyor.control for every layer here
    from conveyor.metrics import LayerMetrics, process_metrics

    metrics = process_metrics(settings.telemetry, "+".join(names))
    layer_metrics = LayerMetrics(metrics.meter)
    runtimes = [LayerRuntime(settings, stage(n).make(settings, registry),
                             producer=producer, tracer=tracing.tracer, cancels=cancels,
                             metrics=layer_metrics)
                for n in names]

    def stop() -> None:
        for r in runtimes:
            r.stop()

    _on_signals(stop)
    tasks = [asyncio.create_task(r.run(), name=r.layer.name) for r in runtimes]
    settling = asyncio.create_task(_settle_when(settings, "+".join(names),
                                                *(r.ready for r in runtimes)), name="settle")
    from topics.models import follow_published

    following = [asyncio.create_task(cancels.run(), name="cancels"),
                 asyncio.create_task(follow_published(settings, registry), name="models")]
    # a runtime ends when it is stopped (a signal) or fails; the followers never
    # end on their own: wait for the first to end, not for all of them
    done, _ = await asyncio.wait([*tasks, *following], return_when=asyncio.FIRST_COMPLETED)
    for r in runtimes:
        r.stop()
    for task in [*following, settling]:
        task.cancel()
    await asyncio.gather(*tasks, *following, settling, return_exceptions=True)
    await producer.stop()
    tracing.shutdown()
    metrics.shutdown()
    for task in done:
        if not task.cancelled():
            task.result()


async def _settle_when(settings: Settings, what: str, *ready: asyncio.Event) -> None:
    """Once every one of ``ready`` is set, the process has started: its heap is
    settled for serving (conveyor/heap.py)."""
    from conveyor import heap

    for event in ready:
        await event.wait()
    heap.settle(settings.process.gc_threshold, what)


def cmd_layer(settings: Settings, args: argparse.Namespace) -> int:
    names = list(args.names) or list(stage_names())
    for name in names:
        try:
            stage(name)
        except UnknownStage as exc:
            raise SystemExit(str(exc)) from None
    _run(_run_layers(settings, names))
    return 0


def _make_engine(args: argparse.Namespace, settings: Settings, registry: Registry) -> Engine:
    from workers.infer.engines.table import EngineOptions, EngineSetupError

    try:
        return EngineOptions.from_args(args).make(registry, settings)
    except EngineSetupError as exc:
        raise SystemExit(str(exc)) from None


async def _run_infer(settings: Settings, args: argparse.Namespace) -> None:
    from workers.infer.worker import InferWorker

    registry = await _serving_registry(settings)  # the engine loads what the fleet serves
    engine = _make_engine(args, settings, registry)
    from topics.tracing import make_tracer

    tracing = make_tracer(settings.telemetry.trace_exporter, f"infer-{args.pool}")
    worker = InferWorker(settings, engine, args.pool, registry, worker_id=args.worker_id,
                         tracer=tracing.tracer)
    from conveyor.metrics import WorkerMetrics, process_metrics
    from workers.infer.engines.base import host_cache_counts

    metrics = process_metrics(settings.telemetry, f"infer-{args.pool}")
    worker.dead_lettered = WorkerMetrics(metrics.meter, worker.worker_id, args.pool,
                                         worker.load, host_cache_counts(engine)).dead_letter
    _on_signals(worker.stop)
    from topics.models import follow_published

    models = asyncio.create_task(follow_published(settings, registry), name="models")
    settling = asyncio.create_task(_settle_when(settings, f"infer {worker.worker_id}",
                                                worker.ready), name="settle")
    try:
        await worker.run()
    finally:
        models.cancel()
        settling.cancel()
        tracing.shutdown()
        metrics.shutdown()


def cmd_infer(settings: Settings, args: argparse.Namespace) -> int:
    _run(_run_infer(settings, args))
    return 0


def _infra(script: str, action: str) -> None:
    path = Path(__file__).resolve().parents[1] / "infra" / script
    subprocess.run(["bash", str(path), action], check=True)


def cmd_up(settings: Settings, args: argparse.Namespace) -> int:
    """Start everything and supervise it; Ctrl-C (or SIGTERM) stops it all."""
    from cli.supervise import Child, Supervisor

    check_exposure(settings, args.insecure_no_auth)
    if not args.no_infra:
        _infra("kafka.sh", "start")
        _infra("redis.sh", "start")
    registry = Registry.load(settings.process.models_file)
    asyncio.run(_ensure_topics(settings, registry))
    exe = [sys.executable, "-m", "cli"]
    from workers.infer.engines.table import EngineOptions

    infer = ["infer", *EngineOptions.from_args(args).argv()]
    port = settings.telemetry.metrics_port  # layers on it, accounting on the next, then each worker

    def on(offset: int) -> list[str]:
        return exe + (["--metrics-port", str(port + offset)] if port else [])

    children = [Child("layers", on(0) + ["layer"]), Child("accounting", on(1) + ["accounting"])]
    children += [Child(f"infer {args.pool}-{i}",
                       on(2 + i) + infer + ["--worker-id", f"{args.pool}-{i}"])
                 for i in range(args.workers)]
    # each embedding model's pool gets a worker of the encoder engine, on the CPU
    # (POST /v1/embeddings), unless --embedding-workers 0
    embedding_pools = sorted({m.pool for m in registry.models.values()
                              if m.kind == "embedding" and m.pool != args.pool})
    for n, pool in enumerate(embedding_pools):
        children += [Child(f"infer {pool}-{i}", on(2 + args.workers + n) + [
            "infer", "--engine", "encoder", "--pool", pool, "--contexts", "8",
            "--worker-id", f"{pool}-{i}"])
            for i in range(args.embedding_workers)]
    gateway = exe + ["gateway"] + (["--insecure-no-auth"] if args.insecure_no_auth else [])
    children.append(Child("gateway", gateway))
    supervisor = Supervisor(children, restart_limit=args.restart_limit)
    signal.signal(signal.SIGINT, supervisor.stop)
    signal.signal(signal.SIGTERM, supervisor.stop)
    print(f"conveyor: serving on http://{settings.gateway.host}:{settings.gateway.port}/v1",
          flush=True)
    return supervisor.run()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="conveyor", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve Prometheus metrics of a layer, infer or accounting "
                             "process on this port (default CONVEYOR_METRICS_PORT; 0: none)")
    sub = parser.add_subparsers(dest="command", required=True)

    def engine_args(p: argparse.ArgumentParser) -> None:
        from workers.infer.engines.table import EngineOptions

        EngineOptions.add_flags(p)  # --engine, --pool and each engine's options

    up = sub.add_parser("up", help="run everything on this host")
    engine_args(up)
    up.add_argument("--workers", type=int, default=1, help="infer workers to start")
    up.add_argument("--embedding-workers", type=int, default=1,
                    help="encoder workers to start for each embedding model's pool (0: none)")
    up.add_argument("--insecure-no-auth", action="store_true",
                    help="serve without authentication on a non-loopback address")
    up.add_argument("--no-infra", action="store_true",
                    help="Kafka and Redis already run: do not start them")
    up.add_argument("--restart-limit", type=int, default=6,
                    help="give up when a process dies this many times in a row, each "
                         "within a minute of its start (1: stop at the first death)")
    up.set_defaults(func=cmd_up)

    gw = sub.add_parser("gateway", help="the HTTP/SSE API")
    gw.add_argument("--insecure-no-auth", action="store_true",
                    help="serve without authentication on a non-loopback address")
    gw.set_defaults(func=cmd_gateway)

    layer = sub.add_parser("layer", help="one or more pipeline layers in one process")
    layer.add_argument("names", nargs="*", metavar="LAYER", default=[],
                       help=f"any of {', '.join(stage_names())} (default: all of them)")
    layer.set_defaults(func=cmd_layer)

    infer = sub.add_parser("infer", help="one infer worker")
    engine_args(infer)
    infer.add_argument("--worker-id", default=None)
    infer.set_defaults(func=cmd_infer)

    topics = sub.add_parser("topics", help="create the topic catalog")
    topics.set_defaults(func=cmd_topics)
    from cli import dlq, groups, jobs, keys, models, policies, replay, usage, workers
    from cli import inspect as inspect_command

    for command in (keys, usage, jobs, inspect_command, dlq, replay, workers, groups, models,
                    policies):
        command.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        settings = load_settings()
    except ValidationError as exc:  # a setting of the environment: name it, no traceback
        return fail("; ".join(f"{ENV_PREFIX}{str(e['loc'][0]).upper()}: {e['msg']}"
                              for e in exc.errors()), 2)
    if args.metrics_port is not None:
        settings = settings.replace(metrics_port=args.metrics_port)
    _setup_logging(settings)
    from conveyor.errors import SchemaError, StartupTimeout
    from schemas.codec import learn_writers

    if settings.process.schema_history is not None:
        try:
            learn_writers(settings.process.schema_history)
        except SchemaError as exc:
            return fail(f"{ENV_PREFIX}SCHEMA_HISTORY: {exc}", 2)
    from conveyor.redis_clients import RedisConnectionError
    from topics.clients import KafkaConnectionError

    try:
        result: int = args.func(settings, args)
    except StartupTimeout as exc:  # it says what it waited for, how long, and where
        return fail(f"conveyor {args.command}: {exc}", 3)
    except KafkaConnectionError as exc:  # a tool run while the broker is down: say so
        return fail(f"conveyor {args.command}: Kafka at {settings.kafka.bootstrap} cannot be "
                    f"reached ({exc}); is it running?", 3)
    except RedisConnectionError as exc:
        where = settings.redis.url.rpartition("@")[2]  # never a password on the screen
        return fail(f"conveyor {args.command}: Redis at {where} cannot be reached "
                    f"({exc}); is it running?", 3)
    return result


if __name__ == "__main__":
    sys.exit(main())
