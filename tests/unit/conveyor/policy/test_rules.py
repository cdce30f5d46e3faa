"""Content policies: a document checked whole (parse_policy), the scopes of a
request combined (PolicyBook), and the event that sets a scope (topics/policies.py,
its pure part: no Kafka)."""

from __future__ import annotations

import hashlib
import textwrap

import pytest

import conveyor.policy.rules as rules
from conveyor.errors import ConveyorError
from conveyor.policy.rules import (
    DEFAULT_SCOPE,
    PolicyBook,
    PolicyDoc,
    key_scope,
    parse_policy,
    tenant_scope,
)
from topics.envelope import now_ms
from topics.policies import check_scope, document_of

MAX_TTL_S = 7 * 86_400


def documented_example() -> str:
    """The TOML of rules.py's module docstring, as an operator would copy it."""
    doc = rules.__doc__
    assert doc is not None
    block = doc.split("::\n", 1)[1].split("\nDecisions:", 1)[0]
    return textwrap.dedent(block)


def refused(text: str) -> str:
    with pytest.raises(ConveyorError) as err:
        parse_policy(text, "policy.toml")
    message = str(err.value)
    assert message.startswith("policy.toml")
    return message


# --- parse_policy --------------------------------------------------------------------------


def test_the_documented_example_is_a_valid_policy() -> None:
    doc = parse_policy(documented_example())
    assert doc == PolicyDoc(
        blocked={"violence": ("how to make a bomb",)},
        input={"custom": ("project nightingale",)},
        output={"custom": ("internal use only",)},
        patterns={"secrets": (r"\bsk-[a-z0-9]{20,}\b",)}, classifier=0.9,
        redact=("email", "phone", "card", "iban", "ip"),
        restore=True, region="US", cache=True, cache_ttl_s=600, semantic_cache=True,
        semantic_similarity=0.95)


def test_an_empty_document_sets_nothing() -> None:
    assert parse_policy("") == PolicyDoc()
    assert parse_policy("[safety]\n[pii]\n[cache]\n") == PolicyDoc()


def test_pii_values_are_normalised() -> None:
    doc = parse_policy('[pii]\nredact = ["ip", "email", "ip"]\nregion = "gb"\n')
    assert doc.redact == ("ip", "email")  # duplicates dropped, order kept
    assert doc.region == "GB"
    assert parse_policy("[pii]\nredact = []\n").redact == ()  # redacts nothing: set, not None


def test_not_toml_is_refused() -> None:
    assert "is not TOML" in refused("[safety\n")


def test_an_unknown_section_is_refused_by_name() -> None:
    message = refused('[moderation]\nblocked = ["x"]\n')
    assert "unknown section [moderation]" in message
    assert "cache, pii, safety" in message
    assert "[colour]" in refused('colour = "red"\n')


def test_a_section_that_is_not_a_table_is_refused() -> None:
    assert "[safety] must be a table" in refused('safety = "strict"\n')


@pytest.mark.parametrize(("text", "field"), [
    ('[safety]\nblock = { x = ["a"] }\n', "safety.block"),
    ('[pii]\nredacted = ["email"]\n', "pii.redacted"),
    ("[cache]\nttl = 60\n", "cache.ttl"),
])
def test_an_unknown_field_is_refused_by_name(text: str, field: str) -> None:
    assert f"unknown field {field} " in refused(text)


def test_a_pattern_that_does_not_compile_is_refused() -> None:
    message = refused("[safety]\npatterns = { secrets = ['sk-[a-z'] }\n")
    assert "'secrets'" in message and "sk-[a-z" in message and "does not compile" in message


def test_a_pattern_that_matches_nothing_is_refused() -> None:
    assert "empty string" in refused("[safety]\npatterns = { anything = ['x*'] }\n")


@pytest.mark.parametrize("name", ["blocked", "input", "output"])
def test_an_empty_term_is_refused(name: str) -> None:
    message = refused(f'[safety]\n{name} = {{ custom = ["fine", "  "] }}\n')
    assert "'custom'" in message and "empty term" in message


def test_an_unknown_pii_entity_is_refused_by_name() -> None:
    message = refused('[pii]\nredact = ["email", "ssn"]\n')
    assert "pii.redact" in message and "'ssn'" in message


@pytest.mark.parametrize("region", ['"USA"', '"U"', '"1A"', '""', "1"])
def test_a_bad_region_is_refused(region: str) -> None:
    assert "pii.region" in refused(f"[pii]\nregion = {region}\n")


@pytest.mark.parametrize("ttl", ["0", "-5", str(MAX_TTL_S + 1), "60.0", '"60"', "true"])
def test_a_cache_ttl_out_of_range_or_not_whole_is_refused(ttl: str) -> None:
    assert "cache.ttl_s" in refused(f"[cache]\nttl_s = {ttl}\n")


def test_the_cache_ttl_bounds_are_accepted() -> None:
    assert parse_policy("[cache]\nttl_s = 1\n").cache_ttl_s == 1
    assert parse_policy(f"[cache]\nttl_s = {MAX_TTL_S}\n").cache_ttl_s == MAX_TTL_S


@pytest.mark.parametrize(("text", "field"), [
    ('[pii]\nrestore = "yes"\n', "pii.restore"),
    ("[pii]\nrestore = 1\n", "pii.restore"),
    ('[cache]\nenabled = "true"\n', "cache.enabled"),
    ("[cache]\nenabled = 0\n", "cache.enabled"),
])
def test_a_flag_that_is_not_a_boolean_is_refused(text: str, field: str) -> None:
    assert f"{field} must be true or false" in refused(text)


@pytest.mark.parametrize(("text", "where"), [
    ('[safety]\nblocked = { violence = "kill" }\n', "safety.blocked.violence"),
    ('[safety]\ninput = { custom = ["ok", 3] }\n', "safety.input.custom"),
    ("[safety]\noutput = { custom = [[\"nested\"]] }\n", "safety.output.custom"),
    ('[safety]\npatterns = { secrets = "sk-.+" }\n', "safety.patterns.secrets"),
])
def test_a_list_that_is_not_a_list_of_strings_is_refused(text: str, where: str) -> None:
    assert f"{where} must be a list of strings" in refused(text)


def test_a_safety_field_that_is_not_a_table_is_refused() -> None:
    assert "safety.blocked must be a table" in refused('[safety]\nblocked = ["kill"]\n')


@pytest.mark.parametrize("redact", ['"email"', '[1]', '["email", true]'])
def test_redact_that_is_not_a_list_of_names_is_refused(redact: str) -> None:
    assert "pii.redact must be a list of entity names" in refused(f"[pii]\nredact = {redact}\n")


# --- PolicyBook ----------------------------------------------------------------------------

DEFAULT = """
[safety]
blocked = { violence = ["kill"] }
patterns = { secrets = ['\\bsk-[a-z0-9]{8,}\\b'] }
[pii]
redact = ["email", "phone"]
region = "US"
[cache]
enabled = true
ttl_s = 600
"""

TENANT = """
[safety]
blocked = { violence = [] }       # cannot take the default's term away
input = { custom = ["nightingale"] }
output = { leaks = ["internal use only"] }
[pii]
redact = []
[cache]
enabled = false
"""

KEY = """
[safety]
input = { custom = ["falcon"] }
[pii]
region = "gb"
[cache]
ttl_s = 60
"""


@pytest.fixture
def book() -> PolicyBook:
    book = PolicyBook()
    assert book.set(DEFAULT_SCOPE, DEFAULT)
    assert book.set(tenant_scope("acme"), TENANT)
    assert book.set(key_scope("k1"), KEY)
    return book


def categories(found: object) -> str | None:
    return getattr(found, "category", None)


def test_an_empty_book_does_nothing() -> None:
    policy = PolicyBook().effective("acme", "k1")
    assert policy.input_terms.empty and policy.output_terms.empty
    assert (policy.redact, policy.restore, policy.region) == ((), True, "US")
    assert (policy.cache, policy.cache_ttl_s, policy.scopes) == (False, 600, ())


def test_safety_lists_are_the_union_of_every_scope(book: PolicyBook) -> None:
    policy = book.effective("acme", "k1")
    assert policy.scopes == ("default", "tenant:acme", "key:k1")
    inputs, outputs = policy.input_terms, policy.output_terms
    # the default's blocked term holds for the tenant that lists the category empty
    assert categories(inputs.first("I will kill it")) == "violence"
    assert categories(outputs.first("I will kill it")) == "violence"
    # patterns go both ways
    assert categories(inputs.first("key sk-abc12345xyz")) == "secrets"
    assert categories(outputs.first("key sk-abc12345xyz")) == "secrets"
    # input terms of tenant and key, on the input only
    assert categories(inputs.first("project nightingale")) == "custom"
    assert categories(inputs.first("operation falcon")) == "custom"
    assert outputs.first("project nightingale") is None
    assert outputs.first("operation falcon") is None
    # the tenant's output term, on the output only
    assert categories(outputs.first("for internal use only")) == "leaks"
    assert inputs.first("for internal use only") is None


def test_pii_and_cache_fields_come_from_the_most_specific_scope(book: PolicyBook) -> None:
    policy = book.effective("acme", "k1")
    assert policy.redact == ()             # the tenant's, over the default's
    assert policy.restore is True          # nobody set it: the built-in default
    assert policy.region == "GB"           # the key's
    assert policy.cache is False           # the tenant's
    assert policy.cache_ttl_s == 60        # the key's


def test_a_request_gets_only_its_own_scopes(book: PolicyBook) -> None:
    tenant_only = book.effective("acme")
    assert tenant_only.scopes == ("default", "tenant:acme")
    assert tenant_only.input_terms.first("operation falcon") is None
    assert (tenant_only.region, tenant_only.cache_ttl_s) == ("US", 600)

    other = book.effective("globex")
    assert other.scopes == ("default",)
    assert other.redact == ("email", "phone") and other.cache is True
    assert other.input_terms.first("project nightingale") is None
    assert categories(other.input_terms.first("kill")) == "violence"

    # a key's policy is the key's, whichever tenant the request names
    keyed = book.effective("globex", "k1")
    assert keyed.scopes == ("default", "key:k1")
    assert (keyed.region, keyed.cache, keyed.cache_ttl_s) == ("GB", True, 60)


def test_set_reports_whether_anything_changed(book: PolicyBook) -> None:
    version = book.version
    assert book.set(tenant_scope("acme"), TENANT) is False
    assert book.version == version
    assert book.set(tenant_scope("acme"), TENANT + "\n# a comment\n") is True
    assert book.version == version + 1
    assert book.scopes() == ["default", "key:k1", "tenant:acme"]


def test_an_empty_text_clears_a_scope(book: PolicyBook) -> None:
    version = book.version
    assert book.set(tenant_scope("acme"), "") is True
    assert book.version == version + 1
    assert book.scopes() == ["default", "key:k1"]
    policy = book.effective("acme")
    assert policy.scopes == ("default",)
    assert policy.input_terms.first("project nightingale") is None
    assert policy.redact == ("email", "phone") and policy.cache is True
    # clearing what is not there changes nothing
    assert book.set(tenant_scope("acme"), "") is False
    assert book.set(tenant_scope("nobody"), "  \n") is False
    assert book.version == version + 1


def test_a_bad_document_raises_and_the_scope_keeps_its_own(book: PolicyBook) -> None:
    before = book.effective("acme", "k1")
    version = book.version
    with pytest.raises(ConveyorError, match="pii.region"):
        book.set(tenant_scope("acme"), '[pii]\nregion = "nowhere"\n', "acme.toml")
    with pytest.raises(ConveyorError, match="^acme.toml: unknown section"):
        book.set(tenant_scope("acme"), "[nope]\n", "acme.toml")
    assert book.version == version
    assert book.scopes() == ["default", "key:k1", "tenant:acme"]
    after = book.effective("acme", "k1")
    assert after is before
    assert categories(after.input_terms.first("project nightingale")) == "custom"
    # and a bad first document leaves the scope unset
    with pytest.raises(ConveyorError):
        book.set(tenant_scope("globex"), "[cache]\nttl_s = 0\n")
    assert "tenant:globex" not in book.scopes()
    assert book.set(tenant_scope("acme"), TENANT) is False  # the good one is still held


def test_effective_is_cached_until_a_document_changes(book: PolicyBook) -> None:
    first = book.effective("acme", "k1")
    assert book.effective("acme", "k1") is first
    assert book.effective("acme") is not first  # another (tenant, key), another policy
    book.set(tenant_scope("acme"), TENANT)  # the same text: nothing changes
    assert book.effective("acme", "k1") is first

    version = book.version
    assert book.set(key_scope("k1"), '[safety]\ninput = { custom = ["osprey"] }\n')
    assert book.version == version + 1
    second = book.effective("acme", "k1")
    assert second is not first
    assert second.input_terms.first("operation falcon") is None
    assert categories(second.input_terms.first("operation osprey")) == "custom"
    assert second.region == "US" and second.cache_ttl_s == 600  # the key no longer sets them
    assert book.effective("acme", "k1") is second


# --- topics/policies: the scope and the event that sets it ---------------------------------


@pytest.mark.parametrize("scope", ["default", "tenant:acme", "key:k1", "tenant:a:b"])
def test_check_scope_accepts_the_three_kinds(scope: str) -> None:
    assert check_scope(scope) == scope


@pytest.mark.parametrize("scope", ["", "Default", "default:x", "tenant:", "tenant:  ",
                                   "key:", "acme", "user:bob", ":acme"])
def test_check_scope_refuses_anything_else(scope: str) -> None:
    with pytest.raises(ConveyorError, match="is not a policy scope") as err:
        check_scope(scope)
    assert repr(scope) in str(err.value)


def test_document_of_a_valid_policy() -> None:
    text = documented_example()
    before = now_ms()
    document = document_of("tenant:acme", text, "acme.toml")
    assert document["scope"] == "tenant:acme"
    assert document["text"] == text
    assert document["digest"] == hashlib.sha256(text.encode()).hexdigest()[:12]
    assert document["source"] == "acme.toml"
    assert document["applied_by"]
    assert before <= document["ts_ms"] <= now_ms()


def test_document_of_an_empty_text_clears() -> None:
    document = document_of("default", "", "")
    assert document["text"] == ""
    assert document["digest"] == hashlib.sha256(b"").hexdigest()[:12]


def test_document_of_refuses_a_bad_scope_or_document() -> None:
    with pytest.raises(ConveyorError, match="is not a policy scope"):
        document_of("tenant:", "", "x.toml")
    with pytest.raises(ConveyorError, match="is not a policy scope"):
        document_of("acme", documented_example(), "x.toml")
    with pytest.raises(ConveyorError, match=r"^x\.toml: cache\.ttl_s"):
        document_of("default", "[cache]\nttl_s = 0\n", "x.toml")


def test_the_semantic_cache_is_off_unless_a_scope_turns_it_on_at_its_similarity() -> None:
    assert (PolicyBook().effective("acme").semantic_cache,
            PolicyBook().effective("acme").semantic_similarity) == (False, 0.95)
    book = PolicyBook()
    book.set(DEFAULT_SCOPE, "[cache]\nsemantic = true\n")
    book.set(tenant_scope("acme"), "[cache]\nsimilarity = 0.9\n")
    book.set(tenant_scope("globex"), "[cache]\nsemantic = false\n")
    acme = book.effective("acme")
    assert (acme.semantic_cache, acme.semantic_similarity) == (True, 0.9)
    assert acme.described()["cache"] == {"enabled": False, "ttl_s": 600, "semantic": True,
                                         "similarity": 0.9}
    assert book.effective("globex").semantic_cache is False
    assert parse_policy("[cache]\nsimilarity = 1\n").semantic_similarity == 1.0


@pytest.mark.parametrize("text", ["[cache]\nsimilarity = 0\n", "[cache]\nsimilarity = 1.2\n",
                                  '[cache]\nsimilarity = "high"\n', "[cache]\nsimilarity = true\n",
                                  "[cache]\nsemantic = 1\n"])
def test_a_wrong_semantic_cache_field_is_refused(text: str) -> None:
    assert "cache.s" in refused(text)
