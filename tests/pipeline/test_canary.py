"""A canary against real processes: ``canary`` in tests/data/models.toml is
served half by SmolLM2's own pool and half by ``smollm2-next`` (another pool,
its own worker); each answer names the deployment that gave it, and says so in
``x-conveyor-deployment``. Without tenants each request is its own key."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable

import httpx
import pytest

from tests.support.pipeline import Pipeline

DEPLOYMENTS = {"smollm2-135m-instruct", "smollm2-next"}


@pytest.fixture(scope="module")
def p(module_pipelines: Callable[..., Pipeline]) -> Pipeline:
    made = module_pipelines(workers=1, contexts=2)
    if "next" not in made.procs:
        made.spawn("next", "infer", "--pool", "cpu-next", *made.engine, "--contexts", "2",
                   "--worker-id", "next")
        made.wait_workers(1, pool="cpu-next")
    return made


def test_a_canary_is_answered_by_its_deployments_each_named(p: Pipeline) -> None:
    answered: Counter[str] = Counter()
    for i in range(16):
        r = httpx.post(f"{p.base_url}/v1/chat/completions", timeout=60, json={
            "model": "canary", "max_tokens": 2,
            "messages": [{"role": "user", "content": f"Count from {i}."}]})
        assert r.status_code == 200, r.text
        model = r.json()["model"]
        assert model in DEPLOYMENTS and r.headers["x-conveyor-deployment"] == model
        assert "x-conveyor-fallback" not in r.headers
        answered[model] += 1
    assert set(answered) == DEPLOYMENTS, answered  # 2 x 0.5^16 that one is missed
    with httpx.stream("POST", f"{p.base_url}/v1/completions", timeout=60, json={
            "model": "canary", "prompt": "1, 2,", "max_tokens": 2, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert chunks and {c["model"] for c in chunks} == {r.headers["x-conveyor-deployment"]}
