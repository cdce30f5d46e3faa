"""``conveyor policies``: the content policies every process applies, changed
live (docs/operating/policies.md; the format in conveyor/policy/rules.py).
``set`` refuses a bad document whole, naming what is wrong, and publishes
nothing then; ``show`` lists every scope set, or what applies to a tenant's
(or key's) requests."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

from cli.text import READ_WITHIN_S, fail, unread, utc
from conveyor.errors import ConveyorError
from conveyor.settings import Settings


def _scope(args: argparse.Namespace) -> str:
    from conveyor.policy.rules import DEFAULT_SCOPE, key_scope, tenant_scope

    if args.default:
        return DEFAULT_SCOPE
    return tenant_scope(args.tenant) if args.tenant else key_scope(args.key)


def _publish(settings: Settings, scope: str, text: str, source: str, dry_run: bool) -> int:
    from topics.admin import ensure_topics
    from topics.catalog import POLICIES
    from topics.models import publish_one
    from topics.policies import document_of

    try:
        document = document_of(scope, text, source)
    except ConveyorError as exc:
        return fail(f"conveyor policies: refused, nothing published: {exc}")
    if dry_run:
        print(f"valid ({document['digest']}); --dry-run: nothing published")
        return 0

    async def publish() -> None:
        await ensure_topics(settings, [POLICIES.spec(settings.kafka)])
        await publish_one(settings, POLICIES, document, scope.encode())

    asyncio.run(publish())
    what = "cleared" if not text.strip() else f"set to {document['digest']}"
    print(f"{scope} {what}: every process applies it within a second")
    return 0


def cmd_policies_set(settings: Settings, args: argparse.Namespace) -> int:
    path = Path(args.file)
    try:
        text = path.read_text()
    except OSError as exc:
        return fail(f"conveyor policies set: {path}: {exc}")
    if not text.strip():
        return fail("conveyor policies set: the file is empty (`conveyor policies clear` "
                    "clears a scope)")
    return _publish(settings, _scope(args), text, str(path.resolve()), args.dry_run)


def cmd_policies_clear(settings: Settings, args: argparse.Namespace) -> int:
    return _publish(settings, _scope(args), "", "", False)


def _effective(settings: Settings, args: argparse.Namespace,
               documents: dict[str, Any]) -> dict[str, Any]:
    from conveyor.policy.rules import PolicyBook

    book = PolicyBook()
    for scope, document in documents.items():
        book.set(scope, document["text"], scope)
    return {"tenant": args.tenant, "key": args.key,
            **book.effective(args.tenant, args.key or "").described()}


def cmd_policies_show(settings: Settings, args: argparse.Namespace) -> int:
    from topics.policies import published_policies

    try:
        documents = asyncio.run(published_policies(settings, READ_WITHIN_S))
    except TimeoutError:
        return unread("policies show", "conveyor.policies was")
    documents = {s: d for s, d in documents.items() if d["text"].strip()}
    if args.tenant:
        out = _effective(settings, args, documents)
        print(json.dumps(out, indent=2) if args.json else "\n".join(
            f"{name}: {value}" for name, value in out.items()))
        return 0
    if args.json:
        print(json.dumps(list(documents.values()), indent=2))
        return 0
    if not documents:
        print("no policy set: nothing is blocked, redacted or cached")
    for scope, d in sorted(documents.items()):
        print(f"== {scope}: {d['digest']}, set by {d['applied_by']} at {utc(d['ts_ms'])} from "
              f"{d['source']}\n{d['text'].rstrip()}")
    return 0


def _scope_args(parser: argparse.ArgumentParser) -> None:
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--default", action="store_true", help="everyone's policy")
    which.add_argument("--tenant", help="one tenant's policy (added to the default)")
    which.add_argument("--key", help="one API key's policy (added to its tenant's)")


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    policies = sub.add_parser("policies", help="content policies: safety lists, PII "
                                               "redaction, the prompt cache; set live")
    psub = policies.add_subparsers(dest="policies_command", required=True)
    set_ = psub.add_parser("set", help="validate a policy file and publish it for a scope")
    _scope_args(set_)
    set_.add_argument("file", help="a policy (TOML; see conveyor/policy/rules.py)")
    set_.add_argument("--dry-run", action="store_true", help="validate only")
    set_.set_defaults(func=cmd_policies_set)
    clear = psub.add_parser("clear", help="remove a scope's policy")
    _scope_args(clear)
    clear.set_defaults(func=cmd_policies_clear)
    show = psub.add_parser("show", help="the policies set, or what applies to a tenant")
    show.add_argument("--tenant", help="what applies to this tenant's requests")
    show.add_argument("--key", help="with --tenant: to this key's requests")
    show.add_argument("--json", action="store_true", help="as JSON")
    show.set_defaults(func=cmd_policies_show)
