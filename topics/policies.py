"""The live content policies: ``conveyor policies set`` publishes one scope's
document to ``conveyor.policies`` (compacted, key = the scope); every process
that applies policies reads them at start (:func:`adopt_policies`) and follows
them (:func:`follow_policies`) into its :class:`~conveyor.policy.rules.PolicyBook`.
A bad document is logged and passed over; clearing a scope publishes its
empty document, not a tombstone.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging

from conveyor.errors import ConveyorError
from conveyor.policy.rules import DEFAULT_SCOPE, PolicyBook, parse_policy
from conveyor.settings import Settings
from schemas.codec import default_codec
from schemas.records import PolicyDocument
from topics.catalog import POLICIES
from topics.envelope import now_ms
from topics.follow import apply_all, follow, snapshot
from topics.models import operator

__all__ = ["PolicyFollower", "adopt_policies", "check_scope", "document_of", "follow_policies",
           "published_policies"]

log = logging.getLogger(__name__)


def check_scope(scope: str) -> str:
    """``default``, ``tenant:<name>`` or ``key:<id>``; ConveyorError otherwise."""
    kind, _, name = scope.partition(":")
    if scope == DEFAULT_SCOPE or kind in ("tenant", "key") and name.strip():
        return scope
    raise ConveyorError(f"{scope!r} is not a policy scope (default, tenant:<name>, key:<id>)")


def document_of(scope: str, text: str, source: str) -> PolicyDocument:
    """The event that sets ``scope`` to ``text`` ("" clears it), once it parses."""
    check_scope(scope)
    if text.strip():
        parse_policy(text, source)
    return PolicyDocument(scope=scope, text=text,
                          digest=hashlib.sha256(text.encode()).hexdigest()[:12],
                          source=source, applied_by=operator(), ts_ms=now_ms())


async def published_policies(settings: Settings, within_s: float) -> dict[str, PolicyDocument]:
    """The latest document of every scope ever set (cleared ones included)."""
    latest: dict[str, PolicyDocument] = {}

    def keep(document: PolicyDocument) -> None:
        latest[document["scope"]] = document

    await snapshot(follow(settings, POLICIES, 0, "beginning"), default_codec(), keep, within_s)
    return latest


async def adopt_policies(settings: Settings, book: PolicyBook) -> int:
    """Serve by every document set before now; how many scopes hold one."""
    for document in (await published_policies(settings,
                                              2 * settings.process.startup_timeout_s)).values():
        _adopt(book, document)
    return len(book.scopes())


async def follow_policies(settings: Settings, book: PolicyBook,
                          ready: asyncio.Event | None = None) -> None:
    """Apply each document set from now on (and the ones before, again), for ever:
    a process's background task."""
    await apply_all(follow(settings, POLICIES, 0, "beginning"), default_codec(),
                    lambda document: _adopt(book, document),
                    None if ready is None else ready.set)


def _adopt(book: PolicyBook, document: PolicyDocument) -> None:
    scope = document["scope"]
    try:
        changed = book.set(scope, document["text"],
                           f"the policy of {scope} set from {document['source'] or 'a file'}")
    except ConveyorError as exc:
        log.error("policies: %s keeps the policy in use: %s", scope, exc)
        return
    if changed:
        log.info("policies: %s now %s (%s, set by %s)", scope,
                 "cleared" if not document["text"].strip() else "serves " + document["digest"],
                 document["source"] or "no file", document["applied_by"])


class PolicyFollower:
    """A layer's book of policies, kept current: ``book`` when its caller keeps
    one current (then :meth:`start` and :meth:`stop` do nothing), else a new one
    read at :meth:`start` (what was set before), then followed in the background
    until :meth:`stop`."""

    def __init__(self, settings: Settings, book: PolicyBook | None = None) -> None:
        self.settings = settings
        self.follows = book is None
        self.book = book if book is not None else PolicyBook()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if not self.follows or self._task is not None:
            return
        from conveyor.startup import kafka_address, started

        await started("the content policies (conveyor.policies)",
                      lambda: adopt_policies(self.settings, self.book), log=log,
                      within=self.settings.process.startup_timeout_s,
                      where=kafka_address(self.settings.kafka.bootstrap))
        self._task = asyncio.create_task(follow_policies(self.settings, self.book),
                                         name="policies")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
