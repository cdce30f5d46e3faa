"""``conveyor models``: the model registry the fleet serves, changed live
(docs/operating/registry.md). ``apply`` refuses a bad file whole, naming the
model and the field, and publishes nothing then; once published on
``conveyor.models`` every process serves by it without a restart
(topics/models.py)."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

from cli.text import READ_WITHIN_S, fail, unread, utc
from conveyor.errors import ConveyorError
from conveyor.registry import ModelSpec, Registry
from conveyor.settings import Settings


def describe(spec: ModelSpec) -> dict[str, Any]:
    """One model as ``show --json`` prints it."""
    return {"name": spec.name, "aliases": list(spec.aliases), "pool": spec.pool or None,
            "context_length": spec.context_length,
            "default_max_tokens": spec.default_max_tokens,
            "fallbacks": list(spec.fallbacks),
            "deployments": dict(spec.deployments),
            **({"routes": {r.name: r.model for r in spec.routes}, "default": spec.default,
                "floor": spec.floor, "encoder": spec.encoder or None} if spec.routes else {})}


def render(registry: Registry) -> str:
    lines = [f"{'MODEL':28} {'POOL':10} {'CONTEXT':>7}  ALIASES / FALLBACKS / DEPLOYMENTS"]
    for spec in sorted(registry.models.values(), key=lambda s: s.name):
        extra = [", ".join(spec.aliases)] if spec.aliases else []
        if spec.fallbacks:
            extra.append("falls back to " + ", ".join(spec.fallbacks))
        if spec.deployments:
            extra.append(" ".join(f"{name}={weight}" for name, weight in spec.deployments))
        if spec.routes:
            extra.append("by meaning: " + " ".join(f"{r.name}->{r.model}" for r in spec.routes)
                         + f", below {spec.floor:g} {spec.default}")
        lines.append(f"{spec.name:28} {spec.pool or '-':10} {spec.context_length:>7}  "
                     f"{'; '.join(extra)}")
    return "\n".join(lines)


def cmd_models_apply(settings: Settings, args: argparse.Namespace) -> int:
    from topics.models import publish, record_of

    path = Path(args.file)
    try:
        record = record_of(path.read_text(), str(path.resolve()))
    except (OSError, ConveyorError) as exc:
        detail = str(exc) if isinstance(exc, ConveyorError) else f"{path}: {exc}"
        return fail(f"conveyor models apply: refused, nothing published: {detail}")
    registry = Registry.parse(record["text"], record["source"])
    print(render(registry))
    if args.dry_run:
        print(f"valid ({record['digest']}); --dry-run: nothing published")
        return 0
    from topics.admin import ensure_topics
    from topics.catalog import catalog

    async def apply() -> None:
        await ensure_topics(settings, catalog(settings.kafka, registry.pools()))  # new pools' first
        await publish(settings, record)

    asyncio.run(apply())
    print(f"applied {record['digest']}: every process serves by it within a second")
    return 0


def cmd_models_show(settings: Settings, args: argparse.Namespace) -> int:
    from topics.models import published

    try:
        record = asyncio.run(published(settings, READ_WITHIN_S))
    except TimeoutError:
        return unread("models show", "conveyor.models was")
    if record is None:
        registry = Registry.load(settings.process.models_file)
        origin: dict[str, Any] = {"applied": None, "file": str(settings.process.models_file)}
    else:
        registry = Registry.parse(record["text"], record["source"])
        origin = {"applied": {"digest": record["digest"], "source": record["source"],
                              "applied_by": record["applied_by"],
                              "applied_at": utc(record["ts_ms"])}}
    if args.json:
        print(json.dumps({**origin, "models": [describe(s) for s in sorted(
            registry.models.values(), key=lambda s: s.name)]}, indent=2))
        return 0
    applied = origin["applied"]
    print(f"serving {settings.process.models_file} (nothing applied)" if applied is None else
          f"serving {applied['digest']}, applied by {applied['applied_by']} at "
          f"{applied['applied_at']} from {applied['source']}")
    print(render(registry))
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    models = sub.add_parser("models", help="the model registry: apply a file live, show it")
    msub = models.add_subparsers(dest="models_command", required=True)
    apply = msub.add_parser("apply", help="validate a registry file and publish it: every "
                                          "process serves by it, without a restart")
    apply.add_argument("file", help="a registry file (TOML, as conveyor/models.toml)")
    apply.add_argument("--dry-run", action="store_true", help="validate only")
    apply.set_defaults(func=cmd_models_apply)
    show = msub.add_parser("show", help="the registry served now")
    show.add_argument("--json", action="store_true", help="as JSON")
    show.set_defaults(func=cmd_models_show)
