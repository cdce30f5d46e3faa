"""Tasks, records and heartbeats for the schedule tests: real, encodable events."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from conveyor.errors import RequestError
from schemas.codec import default_codec
from schemas.records import ErrorInfo, Task, WorkerHeartbeat
from topics.envelope import new_envelope, now_ms
from workers.outputs import Output, error_info
from workers.prefix import PrefixIndex

__all__ = ["Rec", "RecordingSender", "beat", "full_task", "indexed_blocks", "indexed_workers",
           "record_of"]


def indexed_workers(index: PrefixIndex) -> list[str]:
    """The workers ``index`` knows blocks of, guessed or reported."""
    return sorted(set(index._blocks) | {w for w, r in index._reported.items() if r})


def indexed_blocks(index: PrefixIndex) -> int:
    """The blocks ``index`` holds, guessed and reported, over all its workers."""
    return (sum(len(held) for held in index._blocks.values())
            + sum(len(report) for report in index._reported.values()))


@dataclass
class Rec:
    """A record of conveyor.routed as the runtime hands it to the layer."""

    topic: str
    partition: int
    offset: int
    value: bytes | None = None


@dataclass
class RecordingSender:
    """Stands in for workers.outputs.Sender (produce, error_outputs) at the seam."""

    sent: list[Output] = field(default_factory=list)
    errors: list[tuple[str, ErrorInfo]] = field(default_factory=list)

    async def produce(self, outputs: list[Output], stopping: Any = None) -> None:
        for out in outputs:
            if out.event_type == "Reply":
                self.errors.append((out.key or "", out.record["error"]))
            else:
                self.sent.append(out)

    def error_outputs(self, envelope: Any, exc: RequestError,
                      generation: Any = None) -> list[Output]:
        return [Output("sched.replies", "Reply", {"error": error_info(exc)},
                       key=envelope["request_id"], partition=0)]

    def ids(self) -> list[str]:
        return [o.record["envelope"]["request_id"] for o in self.sent]


def full_task(rid: str, *, priority: int = 0, pool: str = "cpu", deadline_ms: int = 0,
              prompt: str = "Say something short.") -> Task:
    env = new_envelope(rid, reply_gateway="g", reply_partition=0, deadline_ms=deadline_ms,
                       priority=priority, job_id="job" if priority else "")
    return {
        "envelope": env,
        "generation": {
            "kind": "chat", "model": "smollm2",
            "messages": [{"role": "user", "content": prompt, "name": None}],
            "prompt": None,
            "sampling": {"temperature": 0.0, "top_p": 1.0, "max_tokens": 8, "stop": [],
                         "seed": None, "presence_penalty": 0.0, "frequency_penalty": 0.0},
            "stream": False, "include_usage": False, "created": 1,
        },
        "prompt": {"text": f"<|user|>{prompt}", "tokens": 12, "exact": True, "max_tokens": 8,
                   "dropped_messages": 0, "fingerprint": "f", "prefix_blocks": []},
        "route": {"model": "smollm2-135m-instruct", "pool": pool, "worker_id": "",
                  "partition": -1},
    }


def record_of(task: Task, partition: int, offset: int, topic: str = "sched.routed") -> Rec:
    """The record ``task`` would be read as (its encoded bytes included)."""
    return Rec(topic, partition, offset, default_codec().encode("Task", task))


def beat(worker: str, *, pool: str = "cpu", partitions: list[int] | None = None,
         capacity: int = 2, running: int = 0, ts_ms: int | None = None) -> WorkerHeartbeat:
    return WorkerHeartbeat(worker_id=worker, pool=pool, engine="e", models=[], state="ready",
                           partitions=partitions or [3], capacity=capacity, running=running,
                           queued=0, ts_ms=now_ms() if ts_ms is None else ts_ms, host="h",
                           gpu_utilization=None, gpu_memory_free=None,
                           interactive_running=0, interactive_ms=0)
