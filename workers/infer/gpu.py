"""What a worker's GPUs are doing, from NVML: the heartbeat's utilisation and free memory.

NVML numbers GPUs in PCI bus order and knows nothing of
``CUDA_VISIBLE_DEVICES``, so :class:`GpuProbe` reads the devices that
variable names: unset, every GPU; integers, NVML indices (equal to CUDA's
under ``CUDA_DEVICE_ORDER=PCI_BUS_ID``); ``GPU-<uuid>`` (or a unique prefix)
and ``MIG-<uuid>`` by UUID (a MIG instance gives no utilisation, only
memory); empty, ``-1`` or ``NoDevFiles``, none. As in CUDA, the list ends at
the first entry that names no device. Several devices report the mean
utilisation and the sum of free memory; a host without NVML reports
``(None, None)`` and is asked again at most once a minute.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["GpuProbe", "visible_entries"]

log = logging.getLogger(__name__)

_RETRY_S = 60.0
_NONE = {"", "-1", "NoDevFiles"}


def visible_entries(value: str | None) -> list[str] | None:
    """The entries of ``CUDA_VISIBLE_DEVICES``: None when unset (every GPU),
    [] for no GPU."""
    if value is None:
        return None
    if value.strip() in _NONE:
        return []
    return [entry.strip() for entry in value.split(",")]


class GpuProbe:
    """Reads the visible GPUs' utilisation and free memory (module docstring)."""

    def __init__(self, env: Mapping[str, str] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 nvml: Callable[[], Any] | None = None) -> None:
        self._env = os.environ if env is None else env
        self._clock = clock
        self._load = nvml or _import_pynvml
        self._nvml: Any = None
        self._handles: list[tuple[Any, bool]] = []  # (handle, utilisation readable)
        self._failed_at: float | None = None

    def read(self) -> tuple[float | None, int | None]:
        """(mean utilisation in percent, free bytes summed), each None when unknown."""
        if not self._ready():
            return None, None
        nvml = self._nvml
        utils: list[float] = []
        free: list[int] = []
        for handle, has_util in self._handles:
            try:
                free.append(int(nvml.nvmlDeviceGetMemoryInfo(handle).free))
                if has_util:
                    utils.append(float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu))
            except nvml.NVMLError:
                # left out of this beat, but one that gives its memory and no
                # utilisation (a GPU in MIG mode: Not Supported) counts its memory
                continue
        return ((sum(utils) / len(utils)) if utils else None), (sum(free) if free else None)

    def _ready(self) -> bool:
        if self._nvml is not None:
            return True
        now = self._clock()
        if self._failed_at is not None and now - self._failed_at < _RETRY_S:
            return False
        try:
            nvml = self._load()
        except ImportError:  # no nvidia-ml-py: a CPU worker, nothing to say
            self._failed_at = now
            return False
        try:
            nvml.nvmlInit()
            self._handles = _handles(nvml, visible_entries(self._env.get("CUDA_VISIBLE_DEVICES")))
        except Exception as exc:  # no driver, no device
            if self._failed_at is None:
                log.info("no GPU figures in the heartbeat: NVML answered %r "
                         "(asked again once a minute)", exc)
            self._failed_at = now
            return False
        self._nvml = nvml
        return True


def _import_pynvml() -> Any:
    import pynvml  # type: ignore[import-not-found]

    return pynvml


def _handles(nvml: Any, entries: list[str] | None) -> list[tuple[Any, bool]]:
    if entries is None:
        return [(nvml.nvmlDeviceGetHandleByIndex(i), True)
                for i in range(nvml.nvmlDeviceGetCount())]
    count = nvml.nvmlDeviceGetCount()
    found: list[tuple[Any, bool]] = []
    for entry in entries:
        if entry.isdigit() and int(entry) < count:
            found.append((nvml.nvmlDeviceGetHandleByIndex(int(entry)), True))
        elif entry.startswith(("GPU-", "MIG-")):
            handle = _by_uuid(nvml, entry, count)
            if handle is None:
                break
            found.append((handle, entry.startswith("GPU-")))
        else:
            break  # CUDA ignores this entry and every one after it
    return found


def _by_uuid(nvml: Any, entry: str, count: int) -> Any:
    """The device of a UUID, or of the one GPU whose UUID it begins (CUDA takes a
    unique prefix); None when there is none."""
    try:
        return nvml.nvmlDeviceGetHandleByUUID(entry)
    except nvml.NVMLError:
        pass
    matches = []
    for i in range(count):
        handle = nvml.nvmlDeviceGetHandleByIndex(i)
        uuid = nvml.nvmlDeviceGetUUID(handle)
        if (uuid.decode() if isinstance(uuid, bytes) else uuid).startswith(entry):
            matches.append(handle)
    return matches[0] if len(matches) == 1 else None
