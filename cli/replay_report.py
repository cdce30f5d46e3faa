"""What ``conveyor replay`` found, as a report: each layer's recorded and
replayed outputs paired in order and compared field by field after
flattening (``generation.messages[0].content``), the fields of
:data:`IGNORED` left out, content shown as sizes unless asked for.
The replay itself is cli/replay.py."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from cli.text import plain

__all__ = ["IGNORED", "Replay", "Step", "diff", "render", "report"]

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
