"""Tenants' prefix caches apart, through the whole pipeline on the real model:
two tenants' keys against a Conveyor with ``CONVEYOR_AUTH=keys`` and one
llama.cpp worker of one context (its host cache on, as ``conveyor infer``
starts it). Tenant B asking tenant A's prompt gets the ``cached_tokens`` an
unseen prompt gets, A's next turn still finds its history, and with
``CONVEYOR_PREFIX_CACHE_SHARED`` B's copy of A's prompt is served from A's
cache."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.auth import SECRET, Replicas
from tests.support.pipeline import LLAMACPP, Pipeline


def _started(logs: Path, **env: str) -> Pipeline:
    p = Pipeline(logs, engine=LLAMACPP, CONVEYOR_AUTH="keys", CONVEYOR_AUTH_SECRET=SECRET, **env)
    try:
        p.cli("topics")
        _, p.api_key = Replicas(p, "", "").key(tenant="ops")
        p.start(workers=1, contexts=1)
    except BaseException:
        p.close()
        raise
    return p


@pytest.fixture(scope="module")
def apart(services: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pipeline]:
    p = _started(tmp_path_factory.mktemp("tenant-caches"))
    try:
        yield p
    finally:
        p.close()


def system(topic: str) -> str:
    return f"You are a guide to {topic}. " + " ".join(
        f"Rule {i}: keep point {i} about {topic} short." for i in range(1, 16))


def ask(p: Pipeline, secret: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    r = httpx.post(f"{p.base_url}/v1/chat/completions", timeout=120,
                   headers={"Authorization": f"Bearer {secret}"},
                   json={"model": "smollm2", "messages": messages, "max_tokens": 4,
                         "temperature": 0})
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def cached(answer: dict[str, Any]) -> int:
    tokens: int = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    return tokens


def test_a_tenant_learns_nothing_of_another_s_prompt_from_cached_tokens(
        apart: Pipeline) -> None:
    keys = Replicas(apart, "", "")
    _, a = keys.key(tenant="tenant-a")
    _, b = keys.key(tenant="tenant-b")
    history = [{"role": "system", "content": system("lighthouses")},
               {"role": "user", "content": "Name one."}]
    first = ask(apart, a, history)
    for topic in ("glaciers", "violins"):  # B's own prompts, the last one unseen
        unseen = ask(apart, b, [{"role": "system", "content": system(topic)},
                                {"role": "user", "content": "Name one."}])
    copied = ask(apart, b, history)
    # A's prompt, in the worker's context or its host cache, serves B no more
    # than a prompt nobody sent: the template's first tokens B's own prompt left
    assert cached(copied) == cached(unseen) < 20, (cached(copied), cached(unseen))
    assert copied["usage"]["prompt_tokens"] == first["usage"]["prompt_tokens"] > 150
    history += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                {"role": "user", "content": "And another?"}]
    again = ask(apart, a, history)
    # A's next turn finds its whole first prompt (restored from host memory)
    assert cached(again) >= first["usage"]["prompt_tokens"], (cached(again), first["usage"])


def test_with_shared_caches_a_tenant_reuses_another_s_prefix(
        services: None, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A deployment for one organisation: every tenant's prompts share the caches."""
    p = _started(tmp_path_factory.mktemp("shared-caches"), CONVEYOR_PREFIX_CACHE_SHARED="true")
    try:
        keys = Replicas(p, "", "")
        _, a = keys.key(tenant="tenant-a")
        _, b = keys.key(tenant="tenant-b")
        history = [{"role": "system", "content": system("lighthouses")},
                   {"role": "user", "content": "Name one."}]
        first = ask(p, a, history)
        copied = ask(p, b, history)
        assert cached(copied) >= first["usage"]["prompt_tokens"] - 1, (
            cached(copied), first["usage"])
    finally:
        p.close()
