"""``conveyor replay REQUEST_ID``: run a recorded request (or a dead letter,
``--from-dlq``) through fresh layers in this process, under a scratch topic
prefix with every reply address blanked, and diff their outputs with the
recorded ones: paired in order, compared field by field after flattening
(``generation.messages[0].content``), :data:`IGNORED` left out. What is
replayed and compared: docs/operating/log-tools.md."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from cli.text import add_report_flags, fail, not_found, print_report
from conveyor.errors import ConveyorError, RequestError, last_line
from conveyor.policy.rules import PolicyBook
from conveyor.registry import Registry
from conveyor.settings import Settings
from gateway.dead_letters import read_letters
from schemas.codec import Codec, default_codec, plain
from topics.lookup import parse_since
from topics.policies import published_policies
from workers.journey import Found, find_journey
from workers.stages import STAGES, stage

__all__ = ["FLOW", "IGNORED", "REPLAYABLE", "Replay", "ReplayError", "Step", "diff",
           "parse_through", "register", "render", "replay_letter", "replay_request", "report",
           "scratch_settings"]

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


def render(rep: dict[str, Any]) -> str:
    """The report for a person: per layer, ``same`` or the differing fields."""
    lines = [f"replay of {rep['request_id']} from {rep['source']} (scratch prefix "
             f"{rep['scratch_prefix']}; not compared: {', '.join(rep['ignored'])})"]
    for x in rep["layers"]:
        lines.append(f"{x['layer']}: {'same' if x['same'] else 'differs'}  "
                     f"(input {', '.join(x['inputs'])}; outputs recorded "
                     f"{x['recorded_outputs']}, replayed {x['replayed_outputs']})")
        err = x["error"]
        if err["recorded"] is not None or err["replayed"] is not None:
            lines.append(f"  error {'same' if err['same'] else 'differs'}: recorded "
                         f"{err['recorded'] or '-'} | replayed {err['replayed'] or '-'}")
        for p in x["outputs"]:
            head = f"  output {p['index']} ({p['recorded_at'] or 'not recorded'})"
            if p.get("missing"):
                lines.append(f"{head}: no {p['missing']} output")
            elif p["same"]:
                lines.append(f"{head}: same")
            else:
                lines.append(f"{head}: {len(p['differ'])} fields differ")
                width = max(len(d["field"]) for d in p["differ"])
                for d in p["differ"]:
                    lines.append(f"    {d['field']:<{width}}  {json.dumps(d['recorded'])}"
                                 f"  ->  {json.dumps(d['replayed'])}")
    return "\n".join(lines)


class ReplayError(ConveyorError):
    """A replay that cannot be made as asked."""


def parse_through(text: str) -> list[str]:
    """``preprocess,route`` as layer names; raises ValueError for a name that is
    not replayed or layers that do not follow one another in the flow."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ValueError("--through names no layer")
    for name in names:
        if name in _REFUSED:
            raise ValueError(_REFUSED[name])
        if name not in REPLAYABLE:
            raise ValueError(f"unknown layer {name!r}; replay runs {', '.join(REPLAYABLE)}")
    at = [FLOW.index(n) for n in names]
    if any(b != a + 1 for a, b in zip(at, at[1:], strict=False)):
        raise ValueError(f"--through {','.join(names)}: the layers must follow one another "
                         f"in the flow ({' -> '.join(FLOW)})")
    return names


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


async def _run(settings: Settings, scratch: Settings, names: list[str],
               inputs: list[Any], steps: list[Step]) -> None:
    """Feed ``inputs`` to fresh instances of ``names`` in turn, filling ``steps``."""
    registry = Registry.load(settings.process.models_file)
    policies = await _policies(settings)
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
        print(f"conveyor replay: {settings.kafka.topic('policies')} was not read within "
              f"{_POLICIES_WITHIN_S:.0f} s; replaying with no content policy", file=sys.stderr)
        return book
    for scope, document in documents.items():
        with contextlib.suppress(ConveyorError):
            book.set(scope, document["text"], f"the policy of {scope}")
    return book


_INPUT_FROM = {"preprocess": "gateway", "route": "preprocess"}  # journey.by_layer


def _recorded(journey: Any, name: str) -> list[Found]:
    if name == "postprocess":
        return [f for f in journey.replies if f.record]
    return [f for f in journey.by_layer.get(name) or [] if f.record][:1]


async def replay_request(settings: Settings, request_id: str, names: list[str],
                         since_ms: int, codec: Codec | None = None) -> Replay | None:
    """Replay ``request_id``'s recorded input of ``names[0]`` through ``names``
    (None when the request is not in the log since ``since_ms``)."""
    journey = await find_journey(settings, request_id, since_ms, codec)
    if journey is None:
        return None
    scratch = scratch_settings(settings)
    first = names[0]
    # postprocess takes every chunk; the others their input event (the first:
    # a redelivery writes the same one again)
    found = (journey.chunks if first == "postprocess"
             else (journey.by_layer.get(_INPUT_FROM[first]) or [])[:1])
    if not found:
        raise ReplayError(f"no recorded input of {first} for request {request_id}")
    unreadable = [f for f in found if f.record is None]
    rep = Replay(request_id, scratch.kafka.topic_prefix, "log")
    errors = {d.record["layer"]: last_line(d.record["error"])
              for d in journey.letters if d.record}
    error_replies = [_reply_error(f.record["error"]) for f in journey.replies
                     if f.record and f.record.get("error")]
    for i, name in enumerate(names):
        recorded = _recorded(journey, name)
        step = Step(name, [f.where for f in found] if i == 0 else [f"replayed {names[i - 1]}"],
                    recorded=[f.record for f in recorded], recorded_at=[f.where for f in recorded])
        step.recorded_error = errors.get(name)
        if step.recorded_error is None and not recorded and error_replies:
            step.recorded_error = error_replies[0]
        rep.steps.append(step)
    if unreadable:  # the runtime dead-letters what it cannot decode
        rep.steps[0].replayed_error = unreadable[0].error  # "SchemaError: ..."
        return rep
    await _run(settings, scratch, names, [f.record for f in found], rep.steps)
    return rep


async def replay_letter(settings: Settings, request_id: str, offset: int,
                        names: list[str] | None, codec: Codec | None = None) -> Replay:
    """Replay the event of the DLQ letter at ``offset`` through ``names``
    (default: the layer that dead-lettered it)."""
    codec = codec or default_codec()
    letters = await read_letters(settings, 0, [offset], codec)
    if not letters:
        raise ReplayError(f"no letter at offset {offset} of {settings.kafka.topic('dlq')}")
    letter = letters[0].letter
    key = (letter["key"] or b"").decode(errors="replace")
    if key != request_id:
        raise ReplayError(f"the letter at offset {offset} is of request {key or '(no key)'}, "
                          f"not {request_id}")
    names = names or parse_through(letter["layer"])
    if names[0] != letter["layer"]:
        raise ReplayError(f"the letter at offset {offset} was written by {letter['layer']}: "
                          f"--through must begin with it")
    scratch = scratch_settings(settings)
    rep = Replay(request_id, scratch.kafka.topic_prefix, f"dlq@{offset}")
    source = f"{settings.kafka.topic('dlq')}[0]@{offset} ({letters[0].source})"
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
    await _run(settings, scratch, names, [event], rep.steps)
    return rep


def cmd_replay(settings: Settings, args: argparse.Namespace) -> int:
    try:
        since = parse_since(args.since)
        names = parse_through(args.through) if args.through else None
        if args.from_dlq is None:
            found = asyncio.run(replay_request(settings, args.request_id,
                                               names or ["preprocess"], since))
            if found is None:
                return fail(not_found("replay", settings, args.request_id, args.since), 1)
        else:
            found = asyncio.run(replay_letter(settings, args.request_id, args.from_dlq, names))
    except (ValueError, ReplayError) as exc:
        return fail(f"conveyor replay: {exc}")
    return print_report(report(found, args.show_content), args.json, render)


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "replay", help="run a recorded request through fresh layers and diff their outputs",
        description="Feeds the request's recorded input events (or a dead letter's) to "
                    "fresh instances of the layers, in this process, under a scratch topic "
                    "prefix with the reply address blanked: nothing reaches a live topic or "
                    "a user. Shows each layer's recorded and replayed outputs as a field "
                    "diff. Replayed: " + ", ".join(REPLAYABLE) + ".")
    add_report_flags(p, "print content fields and the events themselves")
    p.add_argument("--through", default=None,
                   help="consecutive layers, e.g. preprocess,route (default: preprocess, or "
                        "with --from-dlq the letter's layer)")
    p.add_argument("--from-dlq", type=int, default=None, metavar="OFFSET",
                   help="replay the event of the letter at this offset of the DLQ")
    p.set_defaults(func=cmd_replay)
