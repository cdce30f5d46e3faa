"""``conveyor keys`` and ``conveyor tenants`` against the real Kafka and Redis:
the secret is printed once, alone on the last line; nothing else prints it."""

from __future__ import annotations

import argparse
import asyncio
import re
import uuid
from collections.abc import Iterator

import pytest
import redis.asyncio as aioredis
from pydantic import SecretStr

from cli import keys as cli_keys
from conveyor.settings import Settings, load_settings
from gateway.auth.keys import KeyStore
from gateway.auth.types import KeyRecord

pytestmark = pytest.mark.usefixtures("services")


def run(settings: Settings, capsys: pytest.CaptureFixture[str], *argv: str
        ) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="conveyor")
    cli_keys.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    code = args.func(settings, args)
    out, err = capsys.readouterr()
    return code, out, err


async def lookup(settings: Settings, secret: str) -> KeyRecord | None:
    redis = aioredis.from_url(settings.redis.url)
    try:
        return await KeyStore(settings, redis).lookup(secret)
    finally:
        await redis.aclose()


async def forget(settings: Settings) -> None:
    redis = aioredis.from_url(settings.redis.url)
    try:
        async for key in redis.scan_iter(match=f"{settings.kafka.topic_prefix}:*", count=1000):
            await redis.delete(key)
    finally:
        await redis.aclose()


@pytest.fixture
def settings() -> Iterator[Settings]:
    made = load_settings(topic_prefix=f"kc{uuid.uuid4().hex[:10]}",
                    auth_secret=SecretStr("server-secret-of-the-cli-tests"))
    yield made
    asyncio.run(forget(made))


def test_keys_from_create_to_revoke(settings: Settings,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(settings, capsys, "keys", "create", "--tenant", "acme", "--name", "ci",
                       "--rpm", "60", "--models", "smollm2,other", "--expires-in", "30d")
    assert code == 0
    lines = out.splitlines()
    secret = lines[-1]
    assert re.fullmatch(r"cvy-[A-Za-z0-9_-]{40}", secret)
    assert secret not in "\n".join(lines[:-1])
    key_id = re.search(r"key_[0-9a-f]{16}", out)
    assert key_id is not None
    record = asyncio.run(lookup(settings, secret))
    assert record is not None and record.id == key_id.group(0)
    assert record.limits.rpm == 60 and record.models == ("smollm2", "other")
    assert 29.9 * 86400e3 < record.expires_ms - record.created_ms < 30.1 * 86400e3

    code, out, _ = run(settings, capsys, "keys", "list")
    assert code == 0 and secret not in out and secret[4:] not in out
    assert record.hash not in out
    (line,) = out.splitlines()
    assert line.startswith(record.id) and "name=ci" in line and "tenant=acme" in line
    assert "rpm=60" in line and "models=smollm2,other" in line and " active " in line

    code, out, _ = run(settings, capsys, "keys", "update", record.id, "--rpm", "0",
                       "--tpm", "500", "--name", "ci-2", "--models", "")
    assert code == 0 and "rpm=- tpm=500" in out and "name=ci-2" in out and "models=*" in out
    code, out, _ = run(settings, capsys, "keys", "revoke", record.id)
    assert code == 0 and "revoked" in out
    code, out, _ = run(settings, capsys, "keys", "list", "--tenant", "acme")
    assert out.startswith(record.id) and " revoked " in out
    code, out, _ = run(settings, capsys, "keys", "list", "--tenant", "globex")
    assert code == 0 and out == ""
    code, out, _ = run(settings, capsys, "keys", "restore")
    assert code == 0 and "restored 1 keys and 0 tenant policies" in out


def test_an_unknown_key_id_is_a_clear_error(settings: Settings,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("revoke", "update"):
        code, out, err = run(settings, capsys, "keys", command, "key_0123456789abcdef")
        assert code == 1 and out == ""
        assert "no key with id 'key_0123456789abcdef'" in err


def test_create_needs_the_server_secret(capsys: pytest.CaptureFixture[str]) -> None:
    settings = load_settings(topic_prefix=f"kc{uuid.uuid4().hex[:10]}")
    code, out, err = run(settings, capsys, "keys", "create", "--tenant", "acme")
    assert code == 1 and out == "" and "CONVEYOR_AUTH_SECRET" in err


def test_tenants_set_and_list(settings: Settings, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(settings, capsys, "tenants", "set", "acme", "--rpm", "100",
                       "--daily-tokens", "50000")
    assert code == 0 and "rpm=100" in out and "daily_tokens=50000" in out
    run(settings, capsys, "tenants", "set", "acme", "--tpm", "9000", "--daily-tokens", "0")
    run(settings, capsys, "tenants", "set", "globex", "--monthly-tokens", "7")
    code, out, _ = run(settings, capsys, "tenants", "list")
    assert code == 0
    assert out.splitlines() == [
        "acme  rpm=100 tpm=9000 concurrency=-  daily_tokens=-  monthly_tokens=-",
        "globex  rpm=- tpm=- concurrency=-  daily_tokens=-  monthly_tokens=7"]


def test_flags_are_checked_before_anything_runs(settings: Settings,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (("keys", "create", "--tenant", "a", "--rpm", "-1"),
                 ("keys", "create", "--tenant", "a", "--expires-in", "soon"),
                 ("tenants", "set", "a", "--daily-tokens", "x")):
        with pytest.raises(SystemExit) as exited:
            run(settings, capsys, *argv)
        assert exited.value.code == 2
    assert cli_keys.parse_duration("12h") == 43200
    assert cli_keys.parse_duration("90m") == 5400
    assert cli_keys.parse_duration("3600s") == cli_keys.parse_duration("3600") == 3600
    assert cli_keys.parse_duration("30d") == 30 * 86400
