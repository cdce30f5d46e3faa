"""The heartbeat's GPU probe (workers/infer/gpu.py) against a real NVIDIA GPU.

    python -m bench.gpu_probe

Needs ``nvidia-ml-py`` and ``torch`` with CUDA. The GPU under test is the one torch
calls cuda:0: the first of ``CUDA_VISIBLE_DEVICES`` where that is set (the bench
sets ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so that an index means NVML's), else GPU 0.
Reads the probe idle, with 8 GiB taken on the GPU (free memory must fall by at
least 7 GiB), and while bf16 matrix products run (utilisation must pass 50 %);
times a read; and reads it again in processes that see the GPU by its UUID
(timed there too) and by a prefix of it (the same device must be read).
Prints one line a check and exits 1 when one fails, 2 where there is no GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from typing import Any

from workers.infer.gpu import GpuProbe, visible_entries

GIB = 1 << 30
_CHILD = ("import json, time; from workers.infer.gpu import GpuProbe; p = GpuProbe(); "
          "r = p.read(); t = time.perf_counter(); [p.read() for _ in range(1000)]; "
          "print(json.dumps([*r, (time.perf_counter() - t) * 1e3]))")  # µs a read


def _check(ok: bool, what: str) -> bool:
    print(f"{'PASS' if ok else 'FAIL'}: {what}", flush=True)
    return ok


def _busy(torch: Any, seconds: float) -> None:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


def _in_child(visible: str) -> tuple[float | None, int | None, float]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": visible}
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True,
                         text=True, check=True, timeout=60).stdout
    util, free, micros = json.loads(out.strip().splitlines()[-1])
    return util, free, micros


def main() -> int:
    entries = visible_entries(os.environ.get("CUDA_VISIBLE_DEVICES"))
    first = entries[0] if entries else "0"  # the GPU torch calls cuda:0
    os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # read by torch at CUDA's start
    probe = GpuProbe(env={"CUDA_VISIBLE_DEVICES": first})
    idle = probe.read() if entries != [] else (None, None)
    print(f"GPU {first} idle: utilisation {idle[0]} %, free {idle[1]} bytes", flush=True)
    if idle == (None, None):
        print("no GPU (or no nvidia-ml-py) here")
        return 2
    import pynvml  # type: ignore[import-not-found]
    import torch

    results = []
    taken = torch.empty(8 * GIB, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    _, free_taken = probe.read()
    drop = (idle[1] or 0) - (free_taken or 0)
    results.append(_check(drop >= 7 * GIB, f"8 GiB taken: free fell by {drop / GIB:.2f} GiB"))
    del taken
    torch.cuda.empty_cache()

    worker = threading.Thread(target=_busy, args=(torch, 4.0))
    worker.start()
    seen: list[float] = []
    while worker.is_alive():
        util, _ = probe.read()
        seen.append(util or 0.0)
        time.sleep(0.2)
    worker.join()
    results.append(_check(max(seen) > 50, f"under matrix products: utilisation up to "
                          f"{max(seen):.0f} % ({len(seen)} reads)"))

    n = 1000
    start = time.perf_counter()
    for _ in range(n):
        probe.read()
    print(f"a read: {(time.perf_counter() - start) / n * 1e6:.1f} µs", flush=True)

    uuid = first  # where the environment names the GPU by its UUID
    if first.isdigit():
        raw = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(int(first)))
        uuid = raw.decode() if isinstance(raw, bytes) else raw
    _, here = probe.read()
    for visible in (uuid, uuid[:12], f"{first},NoSuchGpu", "-1"):
        util, free, micros = _in_child(visible)
        if visible == uuid:
            print(f"a read by UUID: {micros:.1f} µs", flush=True)
        if visible == "-1":
            results.append(_check((util, free) == (None, None),
                                  "CUDA_VISIBLE_DEVICES=-1: no GPU"))
            continue
        same = free is not None and here is not None and abs(free - here) < GIB
        results.append(_check(same, f"CUDA_VISIBLE_DEVICES={visible}: GPU {first} read "
                              f"({util} %, {free} bytes free)"))
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
