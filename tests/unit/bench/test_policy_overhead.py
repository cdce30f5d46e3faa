"""bench.policy_overhead's varied prompts: each request's text is new and still holds
an address and a phone number the recognisers find, so --vary times real searches."""

from __future__ import annotations

from bench.policy_overhead import varied_prompts
from conveyor.policy.recognisers import find_pii


def test_varied_prompts_never_repeat_and_each_holds_an_email_and_a_phone() -> None:
    prompt = varied_prompts()
    texts = [prompt() for _ in range(2000)]
    assert len(set(texts)) == len(texts)
    for text in texts[::97] + texts[-3:]:
        assert [f.entity for f in find_pii(text)] == ["email", "phone"], text
