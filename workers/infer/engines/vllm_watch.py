"""A watch that ends vLLM's engine processes when the worker that started them dies.

vLLM's engine core and model runner are processes of their own; a SIGKILLed
worker left them waiting for ever, holding weights and KV cache, beside a
restarted worker's new set. The vLLM engine starts this watch beside them:

    python -m workers.infer.engines.vllm_watch WORKER_PID PID...

Twice a second it checks that the worker lives (and is its parent); when it
is gone, SIGTERM to the engine processes and SIGKILL 5 s later. It ends once
the engine processes are gone, or when the engine closes it.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

__all__ = ["main"]

_POLL_S = 0.5
_GRACE_S = 5.0


def main(argv: list[str] | None = None) -> int:
    import psutil

    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2:
        print("usage: python -m workers.infer.engines.vllm_watch WORKER_PID PID...",
              file=sys.stderr)
        return 2
    worker, pids = int(args[0]), [int(a) for a in args[1:]]
    watched: list[Any] = []
    for pid in pids:
        try:
            watched.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    while any(p.is_running() for p in watched):
        if os.getppid() != worker or not psutil.pid_exists(worker):
            _end(watched)
            return 0
        time.sleep(_POLL_S)
    return 0


def _end(processes: list[Any]) -> None:
    import psutil

    alive = [p for p in processes if p.is_running()]
    for process in alive:
        try:
            process.terminate()
        except psutil.NoSuchProcess:
            pass
    _gone, left = psutil.wait_procs(alive, timeout=_GRACE_S)
    for process in left:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


if __name__ == "__main__":
    sys.exit(main())
