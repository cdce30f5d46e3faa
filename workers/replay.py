"""A replay: a recorded request (or a dead letter's event) run through fresh
layers in this process, under a scratch topic prefix with every reply address
blanked, and their outputs diffed with the recorded ones: paired in order,
compared field by field after flattening (``generation.messages[0].content``),
:data:`IGNORED` left out. Nothing is produced, so no topic is made. ``conveyor
replay`` and the console run it; what is replayed and compared:
docs/operating/log-tools.md."""

from __future__ import annotations

import asyncio
import copy
import logging
import time
import traceback
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

from conveyor.errors import ConveyorError, RequestError, last_line
from conveyor.policy.rules import PolicyBook
from conveyor.registry import Registry
from conveyor.settings import Settings
from schemas.codec import Codec, default_codec, plain
from schemas.records import DeadLetter
from topics.models import adopt_published
from topics.policies import published_policies
from workers.journey import Found, Journey, find_journey
from workers.stages import STAGES, stage

__all__ = ["FLOW", "IGNORED", "LOOKBACK_MS", "REPLAYABLE", "Replay", "ReplayError", "Step",
           "chains", "diff", "parse_through", "replay_letter", "replay_request", "report",
           "scratch_settings"]

log = logging.getLogger(__name__)

FLOW = ("preprocess", "route", "schedule", "infer", "postprocess")
REPLAYABLE = tuple(s.name for s in STAGES if s.replayable)
_REFUSED = {
    "schedule": "schedule is not replayed: its answer is the worker partition that the "
                "live workers' heartbeats chose at that moment, which a replay cannot "
                "have (conveyor inspect shows where the task went)",
    "infer": "infer is not replayed: it needs an engine and its model",
}
IGNORED = ("envelope.stamps", "envelope.attempt", "envelope.reply_partition")
_CONTENT = ("generation.messages", "generation.prompt", "prompt.text", "text", "chunk")
_MISSING = "(none)"


@dataclass
class Step:
    """One layer of a replay: what it took, what it wrote then and now."""

    layer: str
    inputs: list[str]  # where each input came from
    recorded: list[Any] = field(default_factory=list)
    recorded_at: list[str] = field(default_factory=list)
    replayed: list[Any] = field(default_factory=list)
    recorded_error: str | None = None
    replayed_error: str | None = None


@dataclass
class Replay:
    request_id: str
    scratch_prefix: str
    source: str  # "log" or "dlq@<offset>"
    steps: list[Step] = field(default_factory=list)


def _flatten(value: Any, path: str = "") -> dict[str, Any]:
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{path}.{k}" if path else str(k)))
        return out
    if isinstance(value, list) and value:
        out = {}
        for i, v in enumerate(value):
            out.update(_flatten(v, f"{path}[{i}]"))
        return out
    return {path: value}


def _ignored(path: str) -> bool:
    return any(path == p or path.startswith(p + ".") for p in IGNORED)


def _content(path: str) -> bool:
    return any(path == p or path.startswith((p + ".", p + "[")) for p in _CONTENT)


def diff(recorded: Any, replayed: Any, show_content: bool = False) -> list[dict[str, Any]]:
    """The fields that differ, flattened (``IGNORED`` left out): field,
    recorded, replayed; content fields as sizes unless ``show_content``."""
    a, b = _flatten(recorded), _flatten(replayed)
    out = []
    for path in sorted(set(a) | set(b)):
        if _ignored(path):
            continue
        x, y = a.get(path, _MISSING), b.get(path, _MISSING)
        if x == y:
            continue
        if not show_content and _content(path):
            x, y = _size(x), _size(y)
        out.append({"field": path, "recorded": x, "replayed": y})
    return out


def _size(value: Any) -> Any:
    return f"<{len(value)} chars>" if isinstance(value, str) and value != _MISSING else value


def report(rep: Replay, show_content: bool = False) -> dict[str, Any]:
    """The replay as a JSON-able dict: per layer, the outputs paired and diffed."""
    layers = []
    for step in rep.steps:
        pairs = []
        for i in range(max(len(step.recorded), len(step.replayed))):
            a = step.recorded[i] if i < len(step.recorded) else None
            b = step.replayed[i] if i < len(step.replayed) else None
            pair: dict[str, Any] = {
                "index": i,
                "recorded_at": step.recorded_at[i] if i < len(step.recorded_at) else None,
                "differ": diff(a, b, show_content) if a is not None and b is not None else [],
            }
            pair["same"] = a is not None and b is not None and not pair["differ"]
            if a is None or b is None:
                pair["missing"] = "recorded" if a is None else "replayed"
            if show_content:
                pair["recorded"], pair["replayed"] = a, b
            pairs.append(pair)
        error_same = step.recorded_error == step.replayed_error
        layers.append({
            "layer": step.layer, "inputs": step.inputs,
            "recorded_outputs": len(step.recorded), "replayed_outputs": len(step.replayed),
            "outputs": pairs,
            "error": {"recorded": step.recorded_error, "replayed": step.replayed_error,
                      "same": error_same},
            "same": error_same and all(p["same"] for p in pairs),
        })
    return plain({  # type: ignore[no-any-return]
        "request_id": rep.request_id, "source": rep.source,
        "scratch_prefix": rep.scratch_prefix, "ignored": list(IGNORED),
        "same": all(x["same"] for x in layers), "layers": layers})


class ReplayError(ConveyorError):
    """A replay that cannot be made as asked."""


def _refused(name: str) -> str | None:
    """Why layer ``name`` is not replayed (None: it is)."""
    if name in _REFUSED:
        return _REFUSED[name]
    if name not in REPLAYABLE:
        return f"unknown layer {name!r}; replay runs {', '.join(REPLAYABLE)}"
    return None


def parse_through(text: str) -> list[str]:
    """``preprocess,route`` as layer names; raises ValueError for a name that is
    not replayed or layers that do not follow one another in the flow."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ValueError("--through names no layer")
    for name in names:
        if (why := _refused(name)) is not None:
            raise ValueError(why)
    at = [FLOW.index(n) for n in names]
    if any(b != a + 1 for a, b in zip(at, at[1:], strict=False)):
        raise ValueError(f"--through {','.join(names)}: the layers must follow one another "
                         f"in the flow ({' -> '.join(FLOW)})")
    return names


def chains(names: list[str]) -> list[list[str]]:
    """``names`` (replayed layers in the flow's order) cut into runs of layers that
    follow one another: ``preprocess, route, postprocess`` is two, since
    postprocess takes infer's output. A run's first layer takes its recorded
    input, each of the others what the one before it wrote. :class:`ReplayError`
    for no layer, a layer not replayed or one out of the flow's order."""
    if not names:
        raise ReplayError("no layer to replay")
    for name in names:
        if (why := _refused(name)) is not None:
            raise ReplayError(why)
    at = [FLOW.index(n) for n in names]
    if any(b <= a for a, b in zip(at, at[1:], strict=False)):
        raise ReplayError(f"the layers {', '.join(names)} are not in the flow's order "
                          f"({' -> '.join(FLOW)})")
    runs = [[names[0]]]
    for a, b, name in zip(at[:-1], at[1:], names[1:], strict=True):
        if b == a + 1:
            runs[-1].append(name)
        else:
            runs.append([name])
    return runs


def scratch_settings(settings: Settings, now_ms: int | None = None) -> Settings:
    """The settings with a scratch topic prefix, ``replay<epoch ms>``."""
    stamp = int(time.time() * 1000) if now_ms is None else now_ms
    return settings.replace(topic_prefix=f"replay{stamp}")


def _reply_error(error: dict[str, Any]) -> str:
    return f"{error['status']} {error['type']}/{error['code']}: {error['message']}"


def _blank_reply(event: Any) -> Any:
    """A copy of ``event`` whose reply address goes nowhere."""
    event = copy.deepcopy(event)
    if isinstance(event, dict) and isinstance(event.get("envelope"), dict):
        event["envelope"]["reply_partition"] = -1
    return event


async def _run(scratch: Settings, registry: Registry, policies: PolicyBook,
               names: list[str], inputs: list[Any], steps: list[Step]) -> None:
    """Feed ``inputs`` to fresh instances of ``names`` in turn, filling ``steps``."""
    for i, (name, step) in enumerate(zip(names, steps, strict=True)):
        layer = stage(name).make(scratch, registry)
        if hasattr(layer, "policies"):  # the live prefix's content policies, not the scratch's
            layer.policies = policies
        try:
            for event in inputs:
                try:
                    outputs = await layer.handle(_blank_reply(event), None)
                except RequestError as exc:
                    step.replayed_error = _reply_error(
                        {"status": exc.status, "type": exc.type, "code": exc.code,
                         "message": exc.message})
                    break
                except Exception:  # what the runtime would dead-letter
                    step.replayed_error = last_line(traceback.format_exc())
                    break
                for out in outputs:
                    if not out.topic.startswith(scratch.kafka.topic("")):
                        raise ReplayError(
                            f"{name} addressed an output to {out.topic}, "
                            f"outside the scratch prefix {scratch.kafka.topic_prefix}")
                    step.replayed.append(out)
        finally:
            await layer.stop()
        if step.replayed_error is not None:
            break
        if i + 1 < len(names):
            wanted = stage(names[i + 1]).source_type
            inputs = [o.record for o in step.replayed if o.event_type == wanted]
    for step in steps:  # compared as records, like the recorded ones
        step.replayed = [o.record for o in step.replayed
                         if o.event_type in stage(step.layer).replayed_types]


_POLICIES_WITHIN_S = 30.0


async def _policies(settings: Settings) -> PolicyBook:
    """The content policies set on the live prefix now (topics/policies.py)."""
    book = PolicyBook()
    try:
        documents = await published_policies(settings, _POLICIES_WITHIN_S)
    except TimeoutError:
        log.warning("replay: %s was not read within %.0f s; replaying with no content policy",
                    settings.kafka.topic("policies"), _POLICIES_WITHIN_S)
        return book
    for scope, document in documents.items():
        try:
            book.set(scope, document["text"], f"the policy of {scope}")
        except ConveyorError:
            continue
    return book


async def _registry(settings: Settings) -> Registry:
    """The registry the live prefix serves by: the one applied last
    (topics/models.py), else the models file's; route's decisions (an alias
    routed by meaning, a canary's deployment) are made again with it."""
    registry = Registry.load(settings.process.models_file)
    try:
        await adopt_published(settings, registry)
    except TimeoutError:
        log.warning("replay: %s was not read in time; replaying with %s",
                    settings.kafka.topic("models"), settings.process.models_file)
    return registry


async def _layers_kit(settings: Settings) -> tuple[Registry, PolicyBook]:
    """What fresh layers are made with: the live prefix's registry and content
    policies."""
    registry, policies = await asyncio.gather(_registry(settings), _policies(settings))
    return registry, policies


_INPUT_FROM = {"preprocess": "gateway", "route": "preprocess"}  # journey.by_layer
# how far back a request is looked for when the caller does not say
LOOKBACK_MS = 7 * 86_400_000


def _recorded(journey: Journey, name: str) -> list[Found]:
    if name == "postprocess":
        return [f for f in journey.replies if f.record]
    return [f for f in journey.by_layer.get(name) or [] if f.record][:1]


def _recorded_input(journey: Journey, name: str) -> list[Found]:
    """What ``name`` took: postprocess every chunk; the others their input event
    (the first: a redelivery writes the same one again)."""
    if name == "postprocess":
        return list(journey.chunks)
    return (journey.by_layer.get(_INPUT_FROM[name]) or [])[:1]


async def replay_request(settings: Settings, request_id: str, names: list[str],
                         since_ms: int | None = None, codec: Codec | None = None
                         ) -> Replay | None:
    """Replay ``request_id`` through the layers ``names`` (in the flow's order;
    each run of consecutive ones from its first layer's recorded input, see
    :func:`chains`); None when the request is not in the log since ``since_ms``
    (default: :data:`LOOKBACK_MS` ago). A run after the first whose input was
    never recorded (the request ended before it) is left out; :class:`ReplayError`
    when the first run's was not."""
    runs = chains(names)
    since = int(time.time() * 1000) - LOOKBACK_MS if since_ms is None else since_ms
    kit = asyncio.create_task(_layers_kit(settings))  # read while the journey is
    try:
        journey = await find_journey(settings, request_id, since, codec)
        return None if journey is None else await _replayed(journey, runs, settings, kit)
    finally:
        kit.cancel()  # done by now, unless the replay ended early
        await asyncio.gather(kit, return_exceptions=True)


async def _replayed(journey: Journey, runs: list[list[str]], settings: Settings,
                    kit: Awaitable[tuple[Registry, PolicyBook]]) -> Replay:
    """The replay of ``journey`` through ``runs``, its layers made with ``kit``."""
    scratch = scratch_settings(settings)
    rep = Replay(journey.request_id, scratch.kafka.topic_prefix, "log")
    errors = {d.record["layer"]: last_line(d.record["error"])
              for d in journey.letters if d.record}
    error_replies = [_reply_error(f.record["error"]) for f in journey.replies
                     if f.record and f.record.get("error")]
    answered = False  # a layer's recorded error is the request's end
    for n, run in enumerate(runs):
        found = _recorded_input(journey, run[0])
        if not found:
            if n == 0:
                raise ReplayError(f"no recorded input of {run[0]} for request "
                                  f"{journey.request_id}")
            break
        steps = []
        for i, name in enumerate(run):
            recorded = _recorded(journey, name)
            step = Step(name, [f.where for f in found] if i == 0 else [f"replayed {run[i - 1]}"],
                        recorded=[f.record for f in recorded],
                        recorded_at=[f.where for f in recorded])
            step.recorded_error = errors.get(name)
            # the error reply is the first layer's that wrote nothing; the
            # layers after it had no input
            if step.recorded_error is None and not recorded and not answered and error_replies:
                step.recorded_error = error_replies[0]
            answered = answered or step.recorded_error is not None
            steps.append(step)
        rep.steps += steps
        unreadable = [f for f in found if f.record is None]
        if unreadable:  # the runtime dead-letters what it cannot decode
            steps[0].replayed_error = unreadable[0].error  # "SchemaError: ..."
            continue
        await _run(scratch, *await kit, run, [f.record for f in found], steps)
    return rep


async def replay_letter(settings: Settings, request_id: str, offset: int, letter: DeadLetter,
                        names: list[str] | None = None, codec: Codec | None = None) -> Replay:
    """Replay the event of ``letter``, the DLQ's letter at ``offset``, through
    ``names`` (default: the layer that dead-lettered it), which must begin with
    that layer and follow one another."""
    codec = codec or default_codec()
    key = (letter["key"] or b"").decode(errors="replace")
    if key != request_id:
        raise ReplayError(f"the letter at offset {offset} is of request {key or '(no key)'}, "
                          f"not {request_id}")
    names = names or [letter["layer"]]
    runs = chains(names)
    if names[0] != letter["layer"]:
        raise ReplayError(f"the letter at offset {offset} was written by {letter['layer']}: "
                          f"--through must begin with it")
    if len(runs) > 1:
        raise ReplayError(f"the layers {', '.join(names)} do not follow one another in the "
                          f"flow ({' -> '.join(FLOW)})")
    scratch = scratch_settings(settings)
    rep = Replay(request_id, scratch.kafka.topic_prefix, f"dlq@{offset}")
    source = (f"{settings.kafka.topic('dlq')}[0]@{offset} "
              f"({letter['topic']}[{letter['partition']}]@{letter['offset']})")
    for i, name in enumerate(names):
        rep.steps.append(Step(name, [source] if i == 0 else [f"replayed {names[i - 1]}"]))
    rep.steps[0].recorded_error = last_line(letter["error"])
    rep.steps[0].recorded_at = [source]
    layer_type = stage(names[0]).source_type
    try:
        event = codec.decode(letter["value"] or b"", layer_type)
    except Exception as exc:  # as the runtime words a poison event
        rep.steps[0].replayed_error = f"SchemaError: {exc}"
        return rep
    await _run(scratch, *await _layers_kit(settings), names, [event], rep.steps)
    return rep
