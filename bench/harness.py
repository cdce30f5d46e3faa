"""The processes a benchmark starts, each in its own process group with a log
file, waited for over HTTP and always stopped (SIGTERM, then SIGKILL) when its
``with`` block ends; :func:`pipeline` is the stage most benchmarks share (the
upstream fixture behind ``conveyor up --engine openai``).
"""

from __future__ import annotations

import asyncio
import atexit
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import httpx

from conveyor.redis_clients import REDIS_ERRORS, redis_client
from conveyor.settings import RedisSettings, load_settings
from infra.services import port_answers, stop_groups
from topics.admin import drop_topics

__all__ = ["BenchError", "Pipeline", "Proc", "as_script", "check_infra", "check_port_free",
           "conveyor_cli", "conveyor_env", "conveyor_up", "loop_factory", "pipeline",
           "repo_root", "running", "spawn", "wait_http"]

# the fixture upstream's answers: TOKENS tokens, DELAY_MS apart when paced
TOKENS = 32
DELAY_MS = 10


def registry(paces_ms: tuple[int, ...]) -> str:
    """The registry of a Conveyor in front of the fixture: model ``bench-<ms>`` is
    the fixture's ``bench@<ms>``, ``<ms>`` between tokens (0: unpaced)."""
    return "\n".join(
        f'[models."bench-{ms}"]\npool = "bench"\ncontext_length = 8192\ndefault_max_tokens = 64\n'
        f'tokenizer = "estimate"\nupstream_model = "bench@{ms}"\n' for ms in paces_ms)


class BenchError(Exception):
    """A benchmark cannot run: the message says why and what to do."""


def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    def exited(self) -> int | None:
        return self.popen.poll()

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


def spawn(name: str, argv: list[str], log_dir: Path, env: Mapping[str, str] | None = None) -> Proc:
    """Start ``argv`` in a new process group, its output appended to
    ``log_dir/name.log`` after a line that says when it started."""
    log_path = log_dir / f"{name}.log"
    with log_path.open("ab") as log:
        log.write(f"===== start {name} at {time.strftime('%H:%M:%S')}\n".encode())
        log.flush()
        popen = subprocess.Popen(argv, cwd=repo_root(), env=dict(env) if env is not None else None,
                                 stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
    return Proc(name, popen, log_path)


@contextmanager
def running(name: str, argv: list[str], log_dir: Path,
            env: Mapping[str, str] | None = None) -> Iterator[Proc]:
    """:func:`spawn`, the whole group stopped on exit."""
    proc = spawn(name, argv, log_dir, env)
    try:
        yield proc
    finally:
        stop_groups([proc.popen])


def wait_http(url: str, proc: Proc, timeout_s: float) -> None:
    """Poll ``GET url`` until it answers 200; fail early if ``proc`` exits."""
    deadline = time.monotonic() + timeout_s
    last = "no answer yet"
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            code = proc.exited()
            if code is not None:
                raise BenchError(f"{proc.name} exited with code {code} before {url} answered "
                                 f"(log {proc.log_path}):\n{proc.log_tail()}")
            try:
                response = client.get(url)
                if response.status_code == 200:
                    return
                last = f"HTTP {response.status_code}"
            except httpx.HTTPError as exc:
                last = type(exc).__name__
            time.sleep(0.25)
    raise BenchError(f"{proc.name}: {url} not ready after {timeout_s:.0f} s ({last}); "
                     f"log {proc.log_path}:\n{proc.log_tail()}")


def check_infra(kafka_port: int = 9092, redis_port: int = 6379) -> None:
    """Conveyor runs with ``--no-infra``: Kafka and Redis must already be up."""
    for what, port in (("kafka", kafka_port), ("redis", redis_port)):
        if not port_answers(port):
            raise BenchError(f"{what.capitalize()} is not answering on 127.0.0.1:{port}: "
                             f"run `bash infra/{what}.sh start`")


def check_port_free(port: int, what: str) -> None:
    if port_answers(port):
        raise BenchError(f"port {port} ({what}) is already in use on 127.0.0.1")


def conveyor_cli(failed: str, *args: str, env: Mapping[str, str] | None = None,
                 timeout_s: float = 60.0) -> str:
    """What ``conveyor <args>`` printed; BenchError starting with ``failed`` and
    the end of its output when it fails."""
    done = subprocess.run([sys.executable, "-m", "cli", *args], cwd=repo_root(), env=env,
                          capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise BenchError(f"{failed}:\n{(done.stderr or done.stdout).strip()[-2000:]}")
    return done.stdout


def drop_redis_keys(url: str, prefix: str) -> None:
    """Delete a finished run's Redis keys (``<prefix>:*``: its ledger and its
    request index, which would stay a week); best effort."""
    async def drop() -> None:
        client = redis_client(RedisSettings(redis_url=url), "cli")
        try:
            keys = [key async for key in client.scan_iter(match=f"{prefix}:*", count=1000)]
            for at in range(0, len(keys), 1000):
                await client.delete(*keys[at:at + 1000])
        except REDIS_ERRORS as exc:
            print(f"the run's Redis keys ({prefix}:*) stay: {exc}", file=sys.stderr)
        finally:
            await client.aclose()
    asyncio.run(drop())


def conveyor_env(*, topic_prefix: str, gateway_port: int, models_file: Path | None = None,
                 services: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a Conveyor run: a fresh topic prefix, the port, and the
    model registry when not the default one. ``services``: the settings of a
    Kafka and a Redis of its own, and no other ``CONVEYOR_`` variable of this
    environment; without them, the run's topics and Redis keys are dropped when
    the benchmark exits (after its finally blocks stopped Conveyor: runs left behind slow the
    broker down)."""
    env = dict(os.environ)
    if services is None:
        defaults = load_settings()
        atexit.register(drop_topics, env.get("CONVEYOR_KAFKA_BOOTSTRAP",
                                             defaults.kafka.bootstrap), topic_prefix)
        atexit.register(drop_redis_keys, env.get("CONVEYOR_REDIS_URL", defaults.redis.url),
                        topic_prefix)
    else:
        env = {k: v for k, v in env.items() if not k.startswith("CONVEYOR_")} | dict(services)
    env["CONVEYOR_TOPIC_PREFIX"] = topic_prefix
    env["CONVEYOR_GATEWAY_PORT"] = str(gateway_port)
    if models_file is not None:
        env["CONVEYOR_MODELS_FILE"] = str(models_file)
    else:
        env.pop("CONVEYOR_MODELS_FILE", None)
    return env


def _raise_exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


@contextmanager
def as_script(prog: str, errors: tuple[type[Exception], ...] = (BenchError,)) -> Iterator[None]:
    """Run a benchmark as a script: SIGTERM turns into SystemExit so that
    ``finally`` blocks stop its processes, and one of ``errors`` (it cannot
    run) exits 2 with the reason."""
    signal.signal(signal.SIGTERM, _raise_exit)
    try:
        yield
    except errors as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop when it is installed (as the gateway runs on it)."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


@dataclass(frozen=True)
class Pipeline:
    """The upstream fixture and a Conveyor in front of it, serving."""

    upstream_url: str
    gateway_url: str
    conveyor: Proc
    upstream: Proc
    env: dict[str, str]  # Conveyor's environment


@contextmanager
def pipeline(upstream_port: int, gateway_port: int, name: str = "bench", *,
             tokens: int = TOKENS, capacity: int = 64, paces_ms: tuple[int, ...] = (DELAY_MS, 0),
             extra_env: Mapping[str, str] | None = None) -> Iterator[Pipeline]:
    """The upstream fixture serves on ``upstream_port`` and ``conveyor up --engine
    openai`` (models ``bench-<ms>`` for each of ``paces_ms``, on a topic prefix of
    its own; ``capacity`` requests in flight to the upstream) in front of it on
    ``gateway_port``, ``extra_env`` added to its environment. Both are stopped
    when the block ends."""
    check_port_free(upstream_port, "upstream")
    work = Path(tempfile.mkdtemp(prefix="conveyor-bench-"))
    print(f"logs and registry in {work}", flush=True)
    models = work / "models.toml"
    models.write_text(registry(paces_ms))
    upstream_url = f"http://127.0.0.1:{upstream_port}"
    fixture = [sys.executable, "-m", "bench.upstream", "--port", str(upstream_port),
               "--tokens", str(max(tokens, TOKENS)), "--delay-ms", str(DELAY_MS)]
    up = ["--engine", "openai", "--upstream", upstream_url, "--pool", "bench", "--capacity",
          str(capacity)]
    with running("upstream", fixture, work) as upstream:
        wait_http(f"{upstream_url}/v1/models", upstream, 30.0)
        with conveyor_up(up, gateway_port, work, 180.0, prefix=name, models_file=models,
                         extra_env=extra_env) as (conveyor, gateway_url, env):
            yield Pipeline(upstream_url, gateway_url, conveyor, upstream, env)


@contextmanager
def conveyor_up(args: list[str], gateway_port: int, work: Path, ready_s: float, *, prefix: str,
                name: str = "conveyor", models_file: Path | None = None,
                extra_env: Mapping[str, str] | None = None
                ) -> Iterator[tuple[Proc, str, dict[str, str]]]:
    """``conveyor up <args> --no-infra`` (Kafka and Redis answer) on ``gateway_port``
    and a topic prefix of its own (``prefix`` and the time), process ``name``
    logging in ``work``, serving within ``ready_s``: its process, the gateway's
    URL and its environment (``extra_env`` added). Stopped when the block ends."""
    check_infra()
    check_port_free(gateway_port, "gateway")
    env = conveyor_env(topic_prefix=f"{prefix}{int(time.time())}", gateway_port=gateway_port,
                       models_file=models_file)
    env.update(extra_env or {})
    gateway_url = f"http://127.0.0.1:{gateway_port}"
    argv = [sys.executable, "-m", "cli", "up", *args, "--no-infra"]
    with running(name, argv, work, env) as proc:
        wait_http(f"{gateway_url}/healthz", proc, ready_s)
        yield proc, gateway_url, env
