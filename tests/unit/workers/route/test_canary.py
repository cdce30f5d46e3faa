"""Canaries: route sends a tenant's requests for a canary to the deployment a
hash of the tenant picks (the same one each time), the route names it and
``deployment_of`` the name asked for; the worker's answer names the deployment,
and the gateway says so in ``x-conveyor-deployment``, not as a fallback."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from conveyor.registry import Registry
from conveyor.settings import load_settings
from gateway.chat.serving import answered_by
from schemas.records import Prepared
from tests.support.schedule_tasks import full_task
from workers.route.layer import RouteLayer

MODELS = '''
[models."v1"]
pool = "cpu"
context_length = 2048
[models."v2"]
pool = "cpu-next"
context_length = 2048
fallbacks = ["v1"]
[models."chat"]
aliases = ["chat-latest"]
deployments = { "v1" = 50, "v2" = 50 }
'''


def prepared(rid: str, tenant: str, model: str = "chat-latest") -> Prepared:
    task = full_task(rid)
    envelope = {**task["envelope"], "tenant": tenant}
    return Prepared(envelope=envelope, generation={**task["generation"], "model": model},
                    prompt=task["prompt"])  # type: ignore[typeddict-item]


async def routes(layer: RouteLayer, rid: str, tenant: str, model: str = "chat-latest"
                 ) -> dict[str, Any]:
    [out] = await layer.handle(prepared(rid, tenant, model), None)
    return dict(out.record["route"])


async def test_each_tenant_gets_one_deployment_and_the_route_says_which(tmp_path: Path) -> None:
    (tmp_path / "models.toml").write_text(MODELS)
    registry = Registry.load(tmp_path / "models.toml")
    layer = RouteLayer(load_settings(topic_prefix="r"), registry)
    seen: dict[str, set[str]] = {}
    for i in range(40):
        tenant = f"t{i % 8}"
        route = await routes(layer, f"r{i}", tenant)
        assert route["deployment_of"] == "chat"
        assert route["pool"] == {"v1": "cpu", "v2": "cpu-next"}[route["model"]]
        seen.setdefault(tenant, set()).add(route["model"])
    assert all(len(models) == 1 for models in seen.values()), seen  # stable per tenant
    assert set().union(*seen.values()) == {"v1", "v2"}  # and both are used
    # the deployment's own fallbacks travel with it
    v2_tenant = next(t for t, models in seen.items() if models == {"v2"})
    route = await routes(layer, "rf", v2_tenant)
    assert route["fallbacks"] == [{"model": "v1", "pool": "cpu"}]
    # a model that is not a canary: no deployment
    assert (await routes(layer, "rp", "t0", model="v1"))["deployment_of"] == ""


def test_the_gateway_names_a_deployment_apart_from_a_fallback(tmp_path: Path) -> None:
    (tmp_path / "models.toml").write_text(MODELS)
    registry = Registry.load(tmp_path / "models.toml")
    assert answered_by(registry, "chat", "v2") == {"x-conveyor-deployment": "v2"}
    assert answered_by(registry, "v2", "v1") == {"x-conveyor-fallback": "v1"}
    assert answered_by(registry, "chat", "chat") == {}


def test_a_tenant_keeps_its_deployment_and_an_anonymous_request_is_its_own_key() -> None:
    from gateway.auth.types import ANONYMOUS_TENANT
    from topics.envelope import ANONYMOUS_TENANT as SEEN_AS_ANONYMOUS
    from topics.envelope import canary_key

    assert SEEN_AS_ANONYMOUS == ANONYMOUS_TENANT
    envelope: Any = {"tenant": "acme", "key_id": "key_1", "request_id": "r1"}
    assert canary_key(envelope) == "acme"
    assert canary_key({**envelope, "tenant": ANONYMOUS_TENANT, "key_id": ""}) == "r1"
    assert canary_key({**envelope, "tenant": ANONYMOUS_TENANT}) == ANONYMOUS_TENANT
