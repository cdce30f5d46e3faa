"""A watch that ends vLLM's engine processes when the worker that started them dies.

vLLM runs its engine core (and, under it, the model runner) in processes of its
own, which wait on a socket for the engine client in the worker. A worker
that is SIGKILLed (the OOM killer, ``kill -9``, a crashed host agent) leaves
them waiting for ever, each holding its weights and KV cache (2-4 GB for
SmolLM2 on a CPU), and a restarted worker starts a second set beside them.
So the vLLM engine starts this watch beside its engine processes:

    python -m workers.infer.engines.vllm_watch WORKER_PID PID...

It checks twice a second that the worker lives (and is still its parent); when
the worker is gone it sends SIGTERM to the engine processes, and SIGKILL to
what remains 5 s later. It ends by itself once the engine processes are gone
(the engine closed them), and the engine's ``close`` ends it too.
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
