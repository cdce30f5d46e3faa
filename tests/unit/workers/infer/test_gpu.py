"""The heartbeat's GPU probe reads the devices the worker can see: CUDA_VISIBLE_DEVICES
mapped to NVML's devices (indices, UUIDs and their prefixes, MIG instances, the list
ended at the first entry naming no device), several devices averaged and summed, NVML
initialised once and asked again at most once a minute where it is missing.

No GPU is here, so NVML is a stand-in with NVML's calls and errors; the probe was
checked against a real GPU once (docs/decisions/0011-vllm-in-the-worker.md)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import pytest

from workers.infer.heartbeat import GpuProbe, visible_entries


class NVMLError(Exception):
    pass


@dataclass
class Device:
    uuid: str
    util: float
    free: int
    broken: bool = False
    no_util: bool = False  # NVML_ERROR_NOT_SUPPORTED, as for a GPU in MIG mode


@dataclass
class FakeNvml:
    """NVML's calls over a list of devices, in PCI bus order."""

    devices: list[Device]
    inits: int = 0
    fail_init: bool = False
    mig: dict[str, Device] = field(default_factory=dict)
    NVMLError: type[Exception] = NVMLError

    def nvmlInit(self) -> None:
        self.inits += 1
        if self.fail_init:
            raise NVMLError("Driver Not Loaded")

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> Device:
        return self.devices[i]

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> Device:
        for device in [*self.devices, *self.mig.values()]:
            if device.uuid == uuid:
                return device
        raise NVMLError("Not Found")

    def nvmlDeviceGetUUID(self, handle: Device) -> bytes:
        return handle.uuid.encode()  # older nvidia-ml-py gives bytes

    def nvmlDeviceGetMemoryInfo(self, handle: Device) -> Any:
        if handle.broken:
            raise NVMLError("GPU is lost")
        return type("Memory", (), {"free": handle.free})()

    def nvmlDeviceGetUtilizationRates(self, handle: Device) -> Any:
        if handle.uuid.startswith("MIG-"):
            raise AssertionError("NVML gives no utilisation for a MIG instance")
        if handle.no_util:
            raise NVMLError("Not Supported")
        return type("Utilization", (), {"gpu": handle.util})()


GIB = 1 << 30


def four_gpus() -> FakeNvml:
    return FakeNvml([Device(f"GPU-{i}aaa-{i}", util=10.0 * (i + 1), free=(i + 1) * GIB)
                     for i in range(4)])


def probe(nvml: FakeNvml, visible: str | None, clock: Any = None) -> GpuProbe:
    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    return GpuProbe(env=env, nvml=lambda: nvml, **({} if clock is None else {"clock": clock}))


@pytest.mark.parametrize(("visible", "expected"), [
    (None, None), ("", []), ("-1", []), ("NoDevFiles", []), ("2, 3", ["2", "3"]),
])
def test_the_visible_entries(visible: str | None, expected: list[str] | None) -> None:
    assert visible_entries(visible) == expected


def test_unset_reads_every_gpu_mean_utilisation_and_summed_free_memory() -> None:
    assert probe(four_gpus(), None).read() == (25.0, 10 * GIB)


def test_the_worker_reads_its_own_gpus_not_the_hosts_first() -> None:
    assert probe(four_gpus(), "3").read() == (40.0, 4 * GIB)
    assert probe(four_gpus(), "1,0").read() == (15.0, 3 * GIB)


def test_uuids_their_unique_prefixes_and_mig_instances_are_found() -> None:
    nvml = four_gpus()
    nvml.mig["MIG-x"] = Device("MIG-x", util=0.0, free=5 * GIB)
    assert probe(nvml, "GPU-2aaa-2").read() == (30.0, 3 * GIB)
    assert probe(nvml, "GPU-3").read() == (40.0, 4 * GIB)
    assert probe(nvml, "MIG-x").read() == (None, 5 * GIB)  # memory only


def test_the_list_ends_at_the_first_entry_naming_no_device() -> None:
    assert probe(four_gpus(), "0,bogus,1").read() == (10.0, 1 * GIB)
    assert probe(four_gpus(), "1,7,2").read() == (20.0, 2 * GIB)
    assert probe(four_gpus(), "GPU-").read() == (None, None)  # a prefix of every GPU
    assert probe(four_gpus(), "-1").read() == (None, None)


def test_nvml_is_initialised_once_and_a_device_that_fails_is_left_out() -> None:
    nvml = four_gpus()
    gpus = probe(nvml, "0,1")
    for _ in range(50):
        gpus.read()
    assert nvml.inits == 1
    nvml.devices[1].broken = True
    assert gpus.read() == (10.0, 1 * GIB)


def test_a_gpu_without_utilisation_still_counts_its_memory() -> None:
    nvml = four_gpus()
    nvml.devices[0].no_util = True
    assert probe(nvml, "0,1").read() == (20.0, 3 * GIB)
    assert probe(nvml, "0").read() == (None, 1 * GIB)


def test_no_driver_is_none_and_asked_again_at_most_once_a_minute() -> None:
    nvml = four_gpus()
    nvml.fail_init = True
    now = [0.0]
    gpus = probe(nvml, "0", clock=lambda: now[0])
    assert gpus.read() == (None, None)
    now[0] = 30.0
    assert gpus.read() == (None, None)
    assert nvml.inits == 1
    nvml.fail_init = False
    now[0] = 61.0
    assert gpus.read() == (10.0, 1 * GIB)
    assert nvml.inits == 2


def test_no_nvml_module_is_none() -> None:
    def missing() -> Any:
        raise ImportError("No module named 'pynvml'")

    assert GpuProbe(env={}, nvml=missing).read() == (None, None)


def test_the_default_loader_imports_pynvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", four_gpus())
    assert GpuProbe(env={"CUDA_VISIBLE_DEVICES": "2"}).read() == (30.0, 3 * GIB)
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    assert GpuProbe(env={}).read() == (None, None)


def test_a_missing_driver_is_said_once_and_a_missing_module_never(
        caplog: pytest.LogCaptureFixture) -> None:
    nvml = four_gpus()
    nvml.fail_init = True
    now = [0.0]
    gpus = probe(nvml, "0", clock=lambda: now[0])
    with caplog.at_level("INFO", logger="workers.infer.heartbeat"):
        for minute in range(3):
            now[0] = 61.0 * minute
            assert gpus.read() == (None, None)

        def missing() -> Any:
            raise ImportError("No module named 'pynvml'")

        assert GpuProbe(env={}, nvml=missing).read() == (None, None)
    assert nvml.inits == 3
    said = [r.getMessage() for r in caplog.records if r.name == "workers.infer.heartbeat"]
    assert len(said) == 1 and "Driver Not Loaded" in said[0], said
