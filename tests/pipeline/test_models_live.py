"""A registry change without a restart, against real processes: ``conveyor
models apply`` publishes a file, and the gateway (its model list), the layers
(route, preprocess) and the worker serve by it within seconds; a bad file is
refused whole and changes nothing; a layers process killed and started again
serves by the applied registry, not by its file."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.pipeline import TEST_MODELS, Pipeline

LIVE_ALIAS = "smollm2-live"


@pytest.fixture(scope="module")
def p(module_pipelines: Callable[..., Pipeline]) -> Iterator[Pipeline]:
    made = module_pipelines(workers=1, contexts=2)
    yield made
    made.cli("models", "apply", str(TEST_MODELS))  # as the file says, for whoever follows


def status_of(p: Pipeline, model: str) -> int:
    r = httpx.post(f"{p.base_url}/v1/chat/completions", timeout=60, json={
        "model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})
    return r.status_code


def until(check: Callable[[], bool], within_s: float = 15.0) -> float:
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < within_s, "not within the bound"
        time.sleep(0.1)
    return time.monotonic() - started


def listed(p: Pipeline) -> set[str]:
    return {m["id"] for m in httpx.get(f"{p.base_url}/v1/models", timeout=10).json()["data"]}


def test_an_applied_registry_is_served_without_a_restart(p: Pipeline, tmp_path: Path) -> None:
    assert status_of(p, LIVE_ALIAS) == 404 and LIVE_ALIAS not in listed(p)
    live = tmp_path / "live.toml"
    live.write_text(TEST_MODELS.read_text().replace(
        'aliases = ["smollm2"]', f'aliases = ["smollm2", "{LIVE_ALIAS}"]'))
    out = p.cli("models", "apply", str(live))
    assert "applied" in out and LIVE_ALIAS in out
    took = until(lambda: LIVE_ALIAS in listed(p))
    print(f"\nthe gateway listed the new alias {took:.2f} s after the apply returned")
    until(lambda: status_of(p, LIVE_ALIAS) == 200)  # route and preprocess know it too
    assert '"applied"' in p.cli("models", "show", "--json")

    # a bad file: refused whole, nothing changes
    bad = tmp_path / "bad.toml"
    bad.write_text(live.read_text() + '\n[models."half"]\ncontext_length = 100\n')
    with pytest.raises(RuntimeError, match="model `half` has no `pool`"):
        p.cli("models", "apply", str(bad))
    assert status_of(p, LIVE_ALIAS) == 200

    # a layers process started again serves by what was applied, not by its file
    p.kill("layers")
    p.respawn("layers")
    p.wait_ready()
    assert status_of(p, LIVE_ALIAS) == 200
