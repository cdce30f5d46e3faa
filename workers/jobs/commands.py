"""The jobs layer: a job's commands (``conveyor.jobs``) become its requests:
``create`` checks a batch's input file (:mod:`workers.jobs.files`) and puts
one request per line on ``conveyor.requests`` (ids: job id and line, so a
command handled twice sends retries), or a background response's one
request; ``cancel`` cancels them on ``conveyor.control``; a command given up
on ends its job (:class:`~workers.jobs.dead_commands.DeadCommands`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

from conveyor.errors import ModelNotFound, RequestError
from conveyor.files.local import LocalFileStore
from conveyor.policy.pii import FindMemo
from conveyor.policy.rules import PolicyBook
from conveyor.registry import Registry
from conveyor.settings import Settings
from schemas.records import Control, Generation, JobCommand, Request
from topics.catalog import CONTROL, JOBS, REQUESTS
from topics.envelope import PRIORITY_BACKGROUND, PRIORITY_BATCH, new_envelope, now_ms
from topics.policies import PolicyFollower
from workers.jobs.dead_commands import DeadCommands
from workers.jobs.files import parse_lines
from workers.layer import Layer
from workers.outputs import Output, Sender, error_info, job_event, result_output
from workers.policy_checks import redact_generation, redacted

__all__ = ["JobsLayer", "request_id_of", "RESPONSE_DEADLINE_MS"]

log = logging.getLogger(__name__)

# how long a background response may wait and run before it expires
RESPONSE_DEADLINE_MS = 24 * 3600 * 1000


def request_id_of(job_id: str, index: int) -> str:
    return f"{job_id}-{index}"


class JobsLayer(Layer):
    name = "jobs"
    source = JOBS

    def __init__(self, settings: Settings, files: LocalFileStore,
                 registry: Registry | None = None, policies: PolicyBook | None = None) -> None:
        """``policies``: a book kept current by the caller; without one the layer
        follows ``conveyor.policies`` itself while it runs (a batch's lines are
        redacted here, workers/policy_checks.py)."""
        self.settings = settings
        self.find_memo = FindMemo()  # batch lines often share their system prompt
        self._follower = PolicyFollower(settings, policies)
        self.policies = self._follower.book
        self.files = files
        self.registry = registry
        self._requests = REQUESTS.at(settings.kafka)
        self._control = CONTROL.at(settings.kafka)
        self._dead: asyncio.Task[None] | None = None

    async def start(self, sender: Sender) -> None:
        await self._follower.start()
        self._dead = asyncio.create_task(DeadCommands(self.settings, sender).run(),
                                         name="jobs-dead-commands")

    async def stop(self) -> None:
        if self._dead is not None:
            self._dead.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._dead
        await self._follower.stop()

    async def handle(self, command: JobCommand, record: Any) -> list[Output]:
        if command["kind"] == "batch":
            if command["action"] == "create":
                return await self._create_batch(command)
            return await self._cancel_batch(command)
        if command["action"] == "create":
            return await self._create_response(command)
        return [*self._cancels(command["job_id"], [command["job_id"]]),
                job_event(self.settings, command["job_id"], "cancel")]

    async def _create_batch(self, command: JobCommand) -> list[Output]:
        job_id = command["job_id"]
        base = json.loads(command["body"] or "{}")
        try:
            data = await self.files.read(command["tenant"], command["input_file_id"])
        except RequestError as exc:
            return [self._invalid(command, base, [{"code": "invalid_file", "line": None,
                                                  "message": exc.message,
                                                  "param": "input_file_id"}])]
        lines, errors = await asyncio.to_thread(parse_lines, data, command["endpoint"],
                                                self.settings.jobs.batch_max_lines)
        if errors:
            return [self._invalid(command, base, errors)]
        deadline_ms = int(base.get("expires_at") or 0) * 1000 or now_ms() + 24 * 3600 * 1000
        detail = json.dumps({"object": base, "total": len(lines), "tenant": command["tenant"]})
        outputs = [job_event(self.settings, job_id, "expanded", detail)]
        allowed = set(command["models"])
        generations = [line.generation for line in lines]
        policy = self.policies.effective(command["tenant"], command["key_id"])
        if policy.redact:  # a batch line enters the log here (a response did at the gateway)
            # every line in one worker thread: the layers process serves the rest meanwhile
            generations = await asyncio.to_thread(
                lambda: [redact_generation(g, policy, self.find_memo)[0] for g in generations])
        for line, generation in zip(lines, generations, strict=True):
            rid = request_id_of(job_id, line.index)
            if allowed and not self._allowed(generation["model"], allowed):
                outputs.append(self._not_allowed(command, rid, line.custom_id,
                                                 generation["model"]))
                continue
            outputs.append(self._request(command, rid, generation, PRIORITY_BATCH,
                                         deadline_ms, line.custom_id))
        log.info("batch %s: %d requests", job_id, len(lines))
        return outputs

    def _allowed(self, model: str, allowed: set[str]) -> bool:
        spec = self.registry.find(model) if self.registry is not None else None
        return model in allowed or (spec is not None and spec.name in allowed)

    def _not_allowed(self, command: JobCommand, request_id: str, item: str,
                     model: str) -> Output:
        """A line asking for a model the caller's key may not use: it fails as if
        the model did not exist, as the same request sent alone would."""
        envelope = new_envelope(request_id, reply_gateway="", reply_partition=-1,
                                tenant=command["tenant"], key_id=command["key_id"],
                                job_id=command["job_id"], job_item=item)
        missing = ModelNotFound(f"The model `{model}` does not exist or you do not have access "
                                "to it.", param="model")
        return result_output(self.settings, envelope, status_code=404, error=error_info(missing))

    def _invalid(self, command: JobCommand, base: dict[str, Any],
                 errors: list[dict[str, Any]]) -> Output:
        job_id = command["job_id"]
        log.info("job %s: invalid (%d errors)", job_id, len(errors))
        return job_event(self.settings, job_id, "invalid", json.dumps(
            {"object": base, "errors": errors, "tenant": command["tenant"]}))

    async def _cancel_batch(self, command: JobCommand) -> list[Output]:
        """Cancel every request of the batch; the input file says how many there are."""
        job_id = command["job_id"]
        try:
            data = await self.files.read(command["tenant"], command["input_file_id"])
        except RequestError:
            data = b""
        count = sum(1 for raw in data.splitlines() if raw.strip())
        ids = [request_id_of(job_id, i) for i in range(count)]
        return [*self._cancels(job_id, ids), job_event(self.settings, job_id, "cancel")]

    async def _create_response(self, command: JobCommand) -> list[Output]:
        job_id = command["job_id"]
        generation = command["generation"]
        base = json.loads(command["body"] or "{}")
        if generation is None:
            return [self._invalid(command, base, [{"code": "invalid_request", "line": None,
                                                  "message": "The response has no request.",
                                                  "param": None}])]
        policy = self.policies.effective(command["tenant"], command["key_id"])
        # The gateway redacted the command's generation already; this layer's policy book
        # may be newer than that gateway's (a policy set since), and the Request it
        # writes must follow the policy in force now. Redacting placeholders again
        # changes nothing, and a background response is one request, not a hot path.
        if policy.redact:
            generation, _ = await redacted(generation, policy)
        deadline_ms = now_ms() + RESPONSE_DEADLINE_MS
        return [job_event(self.settings, job_id, "expanded",
                          json.dumps({"object": base, "total": 1,
                                      "tenant": command["tenant"]})),
                self._request(command, job_id, generation, PRIORITY_BACKGROUND, deadline_ms,
                              "")]

    def _request(self, command: JobCommand, request_id: str, generation: Generation,
                 priority: int, deadline_ms: int, item: str) -> Output:
        envelope = new_envelope(request_id, reply_gateway="", reply_partition=-1,
                                tenant=command["tenant"], key_id=command["key_id"],
                                deadline_ms=deadline_ms, priority=priority,
                                job_id=command["job_id"], job_item=item)
        return Output(self._requests, "Request", Request(envelope=envelope,
                                                         generation=generation),
                      key=request_id)

    def _cancels(self, job_id: str, request_ids: list[str]) -> list[Output]:
        ts = now_ms()
        return [Output(self._control, "Control",
                       Control(request_id=rid, action="cancel",
                               reason=f"job {job_id} cancelled", ts_ms=ts), key=rid)
                for rid in request_ids]
