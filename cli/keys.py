"""``conveyor keys`` and ``conveyor tenants``: API keys and tenant policies from
the shell, written through gateway/auth's stores and audited as ``cli@<host>``.
A limit flag left out keeps what is there, ``0`` clears it; ``keys create``
prints the secret once, alone on the last line. Usage:
docs/operating/keys-and-limits.md."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from cli.text import fail, utc
from conveyor.errors import ConveyorError, TransientBrokerError
from conveyor.redis_clients import redis_client
from conveyor.settings import Settings
from gateway.audit import Audit, cli_actor
from gateway.auth.keys import KeyStore
from gateway.auth.secrets import hash_secret
from gateway.auth.tenants import TenantStore
from gateway.auth.types import KeyRecord, Limits, TenantPolicy
from topics.envelope import now_ms
from topics.lookup import parse_since

__all__ = ["register", "parse_duration", "describe_key", "describe_tenant"]


def parse_duration(text: str) -> float:
    """``30d``, ``12h``, ``90m``, ``3600s`` (or plain seconds) in seconds."""
    ago = "".join(text.split())
    if ago.replace(".", "", 1).isdigit():
        ago += "s"
    try:
        seconds = -parse_since(ago, now_ms=0) / 1000 if ago[-1:] in "smhd" else 0.0
    except ValueError:
        seconds = 0.0
    if seconds <= 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a duration like 30d, 12h, 90m or 3600s")
    return seconds


def _limit(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give 0 (no limit) or a positive number")
    return value


def _models(text: str) -> tuple[str, ...]:
    return tuple(m.strip() for m in text.split(",") if m.strip())


def _opt(value: int | None) -> str:
    return "-" if value is None else str(value)


def _limits(limits: Limits) -> str:
    return " ".join(f"{k}={v}" for k, v in limits.described().items())


def describe_key(record: KeyRecord, now_ms: int) -> str:
    """One line: id, name, tenant, limits, models, expiry, state, last use (no secret)."""
    return "  ".join([
        record.id, f"name={record.name}", f"tenant={record.tenant}", _limits(record.limits),
        f"models={','.join(record.models) or '*'}",
        f"expires={utc(record.expires_ms) if record.expires_ms else 'never'}",
        record.state(now_ms),
        f"last_used={utc(record.last_used_ms) if record.last_used_ms else 'never'}"])


def describe_tenant(policy: TenantPolicy) -> str:
    return "  ".join([policy.name, _limits(policy.limits),
                      f"daily_tokens={_opt(policy.daily_tokens)}",
                      f"monthly_tokens={_opt(policy.monthly_tokens)}"])


def _limits_of(args: argparse.Namespace) -> Limits:
    return Limits(rpm=args.rpm, tpm=args.tpm, concurrency=args.concurrency)


# -- one connection to Kafka and Redis per command ------------------------------------

@dataclass
class _Stores:
    keys: KeyStore
    tenants: TenantStore


async def _with_stores(settings: Settings,
                       action: Callable[[_Stores], Awaitable[None]]) -> None:
    from topics.admin import ensure_topics
    from topics.catalog import catalog
    from topics.clients import make_producer

    await ensure_topics(settings, catalog(settings.kafka))
    producer = make_producer(settings.kafka)
    await producer.start()
    redis = redis_client(settings.redis, "cli")
    try:
        audit = Audit(settings, producer, actor=cli_actor())
        stores = _Stores(keys=KeyStore(settings, redis, producer, audit=audit),
                         tenants=TenantStore(settings, redis, producer, audit=audit))
        await action(stores)
    finally:
        await redis.aclose()
        await producer.stop()


def _command(action: Callable[[_Stores, argparse.Namespace], Awaitable[None]]
             ) -> Callable[[Settings, argparse.Namespace], int]:
    """A subcommand that runs ``action`` on the stores; its errors are one line."""
    def run(settings: Settings, args: argparse.Namespace) -> int:
        try:
            asyncio.run(_with_stores(settings, lambda stores: action(stores, args)))
        except TransientBrokerError as exc:
            return fail(f"conveyor: {exc} (Kafka at {settings.kafka.bootstrap}, Redis at "
                        f"{settings.redis.url}); if a change reached the topic but not Redis, "
                        "`conveyor keys restore` brings Redis up to date", 1)
        except (ConveyorError, ValueError) as exc:
            return fail(f"conveyor: {exc}", 1)
        return 0

    return run


# -- conveyor keys --------------------------------------------------------------------

def cmd_keys_create(settings: Settings, args: argparse.Namespace) -> int:
    try:
        hash_secret(settings.auth, "")  # an empty auth_secret fails before anything is written
    except ConveyorError as exc:
        return fail(f"conveyor: {exc}", 1)
    return _command(_create)(settings, args)


async def _create(stores: _Stores, args: argparse.Namespace) -> None:
    record, secret = await stores.keys.create(
        args.tenant, args.name, _limits_of(args), models=args.models or (),
        expires_in_s=args.expires_in, actor=cli_actor())
    print(f"created {describe_key(record, now_ms())}")
    print("secret (shown this once; Conveyor keeps only its hash):")
    print(secret, flush=True)


async def _list_keys(stores: _Stores, args: argparse.Namespace) -> None:
    now = now_ms()
    for record in await stores.keys.list(args.tenant):
        print(describe_key(record, now))


async def _update(stores: _Stores, args: argparse.Namespace) -> None:
    limits = _limits_of(args)
    record = await stores.keys.update(
        args.id, limits=None if limits.unlimited else limits, models=args.models,
        name=args.name, actor=cli_actor())
    print(f"updated {describe_key(record, now_ms())}")


async def _revoke(stores: _Stores, args: argparse.Namespace) -> None:
    record = await stores.keys.revoke(args.id, actor=cli_actor())
    print(f"revoked {describe_key(record, now_ms())}")


async def _restore(stores: _Stores, args: argparse.Namespace) -> None:
    keys, tenants = await stores.keys.restore()
    print(f"restored {keys} keys and {tenants} tenant policies from "
          f"{stores.keys.settings.kafka.topic('keys')} into Redis")


# -- conveyor tenants -----------------------------------------------------------------

async def _set_tenant(stores: _Stores, args: argparse.Namespace) -> None:
    policy = await stores.tenants.set(args.name, _limits_of(args), args.daily_tokens,
                                      args.monthly_tokens, actor=cli_actor())
    print(f"set {describe_tenant(policy)}")


async def _list_tenants(stores: _Stores, args: argparse.Namespace) -> None:
    for policy in await stores.tenants.list():
        print(describe_tenant(policy))


# -- the parsers ----------------------------------------------------------------------

def _limit_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rpm", type=_limit, default=None, help="requests per minute (0: none)")
    p.add_argument("--tpm", type=_limit, default=None, help="tokens per minute (0: none)")
    p.add_argument("--concurrency", type=_limit, default=None,
                   help="requests in flight at once (0: none)")


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``keys`` and ``tenants`` to the ``conveyor`` command's subparsers."""
    keys = sub.add_parser("keys", help="API keys: create, list, update, revoke, restore")
    ksub = keys.add_subparsers(dest="keys_command", required=True)

    create = ksub.add_parser("create", help="a new key; its secret is the last line printed")
    create.add_argument("--tenant", required=True)
    create.add_argument("--name", default="", help="what the key is for")
    _limit_args(create)
    create.add_argument("--models", type=_models, default=None,
                        help="comma-separated models the key may use (default: every one)")
    create.add_argument("--expires-in", type=parse_duration, default=None,
                        help="30d, 12h, 90m, 3600s (default: never)")
    create.set_defaults(func=cmd_keys_create)

    listing = ksub.add_parser("list", help="every key, one a line (never a secret)")
    listing.add_argument("--tenant", default=None)
    listing.set_defaults(func=_command(_list_keys))

    update = ksub.add_parser("update", help="change a key's limits, models or name")
    update.add_argument("id")
    _limit_args(update)
    update.add_argument("--models", type=_models, default=None,
                        help="comma-separated models ('' : every model)")
    update.add_argument("--name", default=None)
    update.set_defaults(func=_command(_update))

    revoke = ksub.add_parser("revoke", help="revoke a key for good")
    revoke.add_argument("id")
    revoke.set_defaults(func=_command(_revoke))

    restore = ksub.add_parser("restore", help="rebuild Redis's copy from the keys topic")
    restore.set_defaults(func=_command(_restore))

    tenants = sub.add_parser("tenants", help="tenant limits and token quotas")
    tsub = tenants.add_subparsers(dest="tenants_command", required=True)
    tset = tsub.add_parser("set", help="set a tenant's limits and quotas (0 clears one)")
    tset.add_argument("name")
    _limit_args(tset)
    tset.add_argument("--daily-tokens", type=_limit, default=None,
                      help="tokens per UTC day (0: no quota)")
    tset.add_argument("--monthly-tokens", type=_limit, default=None,
                      help="tokens per UTC calendar month (0: no quota)")
    tset.set_defaults(func=_command(_set_tenant))
    tlist = tsub.add_parser("list", help="every tenant with a policy")
    tlist.set_defaults(func=_command(_list_tenants))
