"""``conveyor``: run the whole pipeline in one go, or each process alone.

    conveyor up [--engine llamacpp|openai] ...   Kafka topics, layers, an infer worker, gateway
    conveyor gateway                             the HTTP/SSE API
    conveyor layer preprocess route ...          one or more layers in one process
    conveyor infer --pool cpu --engine llamacpp  one infer worker
    conveyor topics                              create the topic catalog

Every process reads the same settings (``CONVEYOR_*`` environment
variables), so the same commands spread over many hosts against one Kafka
cluster give a multi-node deployment.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from conveyor.registry import Registry
from conveyor.settings import Settings, load_settings

__all__ = ["main"]

LAYERS = ("preprocess", "route", "schedule", "postprocess")
_STDERR_TAIL_LINES = 8
log = logging.getLogger("conveyor")


def _setup_logging(settings: Settings) -> None:
    from conveyor.logs import setup_logging

    setup_logging(settings.log_level)


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

    await ensure_topics(settings, catalog(settings, registry.pools()))


# -- subcommands ----------------------------------------------------------------


def cmd_topics(settings: Settings, args: argparse.Namespace) -> int:
    registry = Registry.load(settings.models_file)
    asyncio.run(_ensure_topics(settings, registry))
    return 0


def cmd_gateway(settings: Settings, args: argparse.Namespace) -> int:
    import uvicorn

    from gateway.app import build_app

    registry = Registry.load(settings.models_file)
    asyncio.run(_ensure_topics(settings, registry))
    uvicorn.run(build_app(settings, registry), host=settings.gateway_host,
                port=settings.gateway_port, loop="uvloop", http="httptools",
                log_level="warning", access_log=False, timeout_graceful_shutdown=5)
    return 0


def _make_layer(name: str, settings: Settings, registry: Registry) -> object:
    if name == "preprocess":
        from workers.preprocess import PreprocessLayer

        return PreprocessLayer(settings, registry)
    if name == "route":
        from workers.route import RouteLayer

        return RouteLayer(settings, registry)
    if name == "schedule":
        from workers.schedule import ScheduleLayer

        return ScheduleLayer(settings)
    if name == "postprocess":
        from workers.postprocess import PostprocessLayer

        return PostprocessLayer(settings)
    raise SystemExit(f"unknown layer {name!r}; choose from {', '.join(LAYERS)}")


async def _run_layers(settings: Settings, names: list[str]) -> None:
    from workers.runtime import LayerRuntime

    registry = Registry.load(settings.models_file)
    await _ensure_topics(settings, registry)
    from topics.clients import make_producer

    producer = make_producer(settings)
    await producer.start()
    from conveyor.tracing import make_tracer

    tracing = make_tracer(settings.trace_exporter, "+".join(names))
    runtimes = [LayerRuntime(settings, _make_layer(n, settings, registry),  # type: ignore[arg-type]
                             producer=producer, tracer=tracing.tracer)
                for n in names]

    def stop() -> None:
        for r in runtimes:
            r.stop()

    _on_signals(stop)
    tasks = [asyncio.create_task(r.run(), name=r.layer.name) for r in runtimes]
    done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    for r in runtimes:
        r.stop()
    await asyncio.gather(*tasks, return_exceptions=True)
    await producer.stop()
    tracing.shutdown()
    for task in done:
        task.result()


def cmd_layer(settings: Settings, args: argparse.Namespace) -> int:
    names = list(args.names) or list(LAYERS)
    unknown = [n for n in names if n not in LAYERS]
    if unknown:
        raise SystemExit(f"unknown layer {unknown[0]!r}; choose from {', '.join(LAYERS)}")
    _run(_run_layers(settings, names))
    return 0


def _make_engine(args: argparse.Namespace, settings: Settings, registry: Registry) -> object:
    if args.engine == "llamacpp":
        from workers.infer.engines.llamacpp import LlamaCppEngine

        models = [m for m in registry.models.values() if m.pool == args.pool and m.gguf]
        if not models:
            raise SystemExit(f"no model with a gguf file in pool {args.pool!r}")
        return LlamaCppEngine.from_spec(models[0], contexts=args.contexts,
                                        n_threads=args.threads)
    if args.engine == "openai":
        from workers.infer.engines.openai_http import OpenAIHttpEngine

        if not args.upstream:
            raise SystemExit("--engine openai needs --upstream URL")
        return OpenAIHttpEngine(args.upstream, capacity=args.capacity)
    if args.engine == "vllm":
        raise SystemExit("the vLLM engine needs the gpu extra and a GPU host")
    raise SystemExit(f"unknown engine {args.engine!r}")


async def _run_infer(settings: Settings, args: argparse.Namespace) -> None:
    from workers.infer.worker import InferWorker

    registry = Registry.load(settings.models_file)
    await _ensure_topics(settings, registry)
    engine = _make_engine(args, settings, registry)
    from conveyor.tracing import make_tracer

    tracing = make_tracer(settings.trace_exporter, f"infer-{args.pool}")
    worker = InferWorker(settings, engine, args.pool, registry,  # type: ignore[arg-type]
                         worker_id=args.worker_id, tracer=tracing.tracer)
    _on_signals(worker.stop)
    try:
        await worker.run()
    finally:
        tracing.shutdown()


def cmd_infer(settings: Settings, args: argparse.Namespace) -> int:
    _run(_run_infer(settings, args))
    return 0


def _infra(script: str, action: str) -> None:
    path = Path(__file__).resolve().parents[1] / "infra" / script
    subprocess.run(["bash", str(path), action], check=True)


class _Child:
    """One supervised process of ``conveyor up``: its command, its current process, and
    the count of quick deaths in a row that sets its backoff."""

    def __init__(self, name: str, command: list[str]) -> None:
        self.name = name
        self.command = command
        self.proc: subprocess.Popen[bytes] | None = None
        self.started = 0.0
        self.restart_at = 0.0
        self.quick_deaths = 0
        self.stderr_tail: deque[str] = deque(maxlen=_STDERR_TAIL_LINES)
        self._pump: threading.Thread | None = None

    def start(self) -> int:
        self.stderr_tail.clear()
        self.proc = proc = subprocess.Popen(self.command, env=os.environ.copy(),
                                            stderr=subprocess.PIPE)
        self.started = time.monotonic()
        self._pump = threading.Thread(target=self._forward_stderr, args=(proc,),
                                      name=f"stderr-{self.name}", daemon=True)
        self._pump.start()
        return proc.pid

    def _forward_stderr(self, proc: subprocess.Popen[bytes]) -> None:
        """Copy the child's stderr to ours line by line, keeping its last lines."""
        assert proc.stderr is not None
        out = getattr(sys.stderr, "buffer", None)
        for line in proc.stderr:
            if out is not None:
                out.write(line)
                out.flush()
            else:
                sys.stderr.write(line.decode(errors="replace"))
            self.stderr_tail.append(line.decode(errors="replace").rstrip())

    def reap(self) -> str:
        """Why the child ended (its stderr read to the end): an exit code or a signal."""
        if self._pump is not None:
            self._pump.join(timeout=2)
        assert self.proc is not None and self.proc.returncode is not None
        code = self.proc.returncode
        if code < 0:
            try:
                return f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"was killed by signal {-code}"
        return f"exited with code {code}"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.terminate()

    def wait(self, timeout: float) -> None:
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self._pump is not None:
            self._pump.join(timeout=2)


class _Supervisor:
    """Keeps ``conveyor up``'s processes running.

    A child that dies is started again after a backoff that doubles from 1 s
    to 30 s with each quick death in a row (one within 60 s of its start); a
    child that ran longer starts from 1 s again. Each death is logged with the
    child's name, pid, exit code or signal (SIGKILL, SIGILL...) and the last
    lines of its stderr, which still reaches the terminal as it is written.
    Only a child that dies quickly ``restart_limit`` times in a row makes
    Conveyor give up: everything is stopped and ``up`` exits 1 (a child that
    cannot start, such as a bad engine option or a CPU the build does not
    fit, never gets better by being started forever). SIGINT and SIGTERM stop
    every child (gateway first, so no new request enters) and exit 0.
    """

    backoff_first_s = 1.0
    backoff_max_s = 30.0
    healthy_after_s = 60.0

    def __init__(self, children: list[_Child], restart_limit: int) -> None:
        self.children = children
        self.restart_limit = max(1, restart_limit)
        self.stopping = False

    def stop(self, *_: object) -> None:
        self.stopping = True

    def run(self) -> int:
        for child in self.children:
            child.start()
        code = 0
        while not self.stopping and code == 0:
            now = time.monotonic()
            for child in self.children:
                if child.proc is None:
                    if now >= child.restart_at:
                        log.info("started %s again (pid %d)", child.name, child.start())
                elif child.proc.poll() is not None and not self.stopping:
                    code = self._on_death(child, now)
                    if code:
                        break
            time.sleep(0.2)
        for child in reversed(self.children):
            child.stop()
        for child in reversed(self.children):
            child.wait(timeout=40)
        return code

    def _on_death(self, child: _Child, now: float) -> int:
        assert child.proc is not None
        why, pid, ran = child.reap(), child.proc.pid, now - child.started
        tail = "".join(f"\n    {line}" for line in child.stderr_tail)
        tail = f"; its last stderr lines:{tail}" if tail else ""
        child.quick_deaths = child.quick_deaths + 1 if ran < self.healthy_after_s else 1
        if child.quick_deaths >= self.restart_limit:
            log.error(f"{child.name} (pid {pid}) {why} after {ran:.1f} s, {child.quick_deaths} "
                      f"times in a row within {self.healthy_after_s:.0f} s of its start: "
                      f"giving up, stopping everything{tail}")
            return 1
        delay = min(self.backoff_max_s,
                    self.backoff_first_s * 2 ** (child.quick_deaths - 1))
        # formatted here, not by logging: the repeat filter holds back records of one
        # template, and every death must be told
        log.error(f"{child.name} (pid {pid}) {why} after {ran:.1f} s; "
                  f"restarting it in {delay:.0f} s{tail}")
        child.proc, child.restart_at = None, now + delay
        return 0


def cmd_up(settings: Settings, args: argparse.Namespace) -> int:
    """Start everything and supervise it; Ctrl-C (or SIGTERM) stops it all."""
    if not args.no_infra:
        _infra("kafka.sh", "start")
        _infra("redis.sh", "start")
    registry = Registry.load(settings.models_file)
    asyncio.run(_ensure_topics(settings, registry))
    exe = [sys.executable, "-m", "conveyor.cli"]
    infer = ["infer", "--pool", args.pool, "--engine", args.engine,
             "--contexts", str(args.contexts), "--threads", str(args.threads),
             "--capacity", str(args.capacity)]
    if args.upstream:
        infer += ["--upstream", args.upstream]
    children = [_Child("layers", exe + ["layer"])]
    children += [_Child(f"infer {args.pool}-{i}", exe + infer + ["--worker-id", f"{args.pool}-{i}"])
                 for i in range(args.workers)]
    children.append(_Child("gateway", exe + ["gateway"]))
    supervisor = _Supervisor(children, restart_limit=args.restart_limit)
    signal.signal(signal.SIGINT, supervisor.stop)
    signal.signal(signal.SIGTERM, supervisor.stop)
    print(f"conveyor: serving on http://{settings.gateway_host}:{settings.gateway_port}/v1",
          flush=True)
    return supervisor.run()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="conveyor", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def engine_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--pool", default="cpu")
        p.add_argument("--engine", choices=["llamacpp", "openai", "vllm"], default="llamacpp")
        p.add_argument("--contexts", type=int, default=2,
                       help="llamacpp: sequences served at once")
        p.add_argument("--threads", type=int, default=1, help="llamacpp: threads per context")
        p.add_argument("--upstream", default=None, help="openai: the upstream's base URL")
        p.add_argument("--capacity", type=int, default=64,
                       help="openai: requests in flight to the upstream")

    up = sub.add_parser("up", help="run everything on this host")
    engine_args(up)
    up.add_argument("--workers", type=int, default=1, help="infer workers to start")
    up.add_argument("--no-infra", action="store_true",
                    help="Kafka and Redis already run: do not start them")
    up.add_argument("--restart-limit", type=int, default=6,
                    help="give up when a process dies this many times in a row, each "
                         "within a minute of its start (1: stop at the first death)")
    up.set_defaults(func=cmd_up)

    gw = sub.add_parser("gateway", help="the HTTP/SSE API")
    gw.set_defaults(func=cmd_gateway)

    layer = sub.add_parser("layer", help="one or more pipeline layers in one process")
    layer.add_argument("names", nargs="*", metavar="LAYER", default=[],
                       help=f"any of {', '.join(LAYERS)} (default: all of them)")
    layer.set_defaults(func=cmd_layer)

    infer = sub.add_parser("infer", help="one infer worker")
    engine_args(infer)
    infer.add_argument("--worker-id", default=None)
    infer.set_defaults(func=cmd_infer)

    topics = sub.add_parser("topics", help="create the topic catalog")
    topics.set_defaults(func=cmd_topics)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    settings = load_settings()
    _setup_logging(settings)
    result: int = args.func(settings, args)
    return result


if __name__ == "__main__":
    sys.exit(main())
