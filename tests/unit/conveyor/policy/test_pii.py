"""Personal data: each recogniser finds its values with the right spans and leaves their
near-misses alone (bad checksums, impossible addresses, version strings); overlaps keep
one value; a request's redactor numbers placeholders per entity and reuses them; a
restore puts back exactly the originals and nothing where the user typed a placeholder;
a streamed restore equals the whole one however the answer is chunked, holding back less
than one placeholder."""

from __future__ import annotations

from collections.abc import Collection

import phonenumbers
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.policy.pii import _PHONE_MIN_INTERNATIONAL_DIGITS as PHONE_MIN_DIGITS
from conveyor.policy.pii import (
    ENTITIES,
    IBAN_LENGTHS,
    Found,
    Redactor,
    find_pii,
)
from conveyor.policy.restore import Restorer


def _iban(country: str, bban: str) -> str:
    """An IBAN with the right check digits for ``country`` + ``bban`` (ISO 13616)."""
    digits = "".join(str(int(ch, 36)) for ch in bban + country + "00")
    return f"{country}{98 - int(digits) % 97:02d}{bban}"


def _spans(
    text: str, entities: Collection[str] = ENTITIES, region: str = "US"
) -> list[tuple[str, str]]:
    return [(f.entity, f.text) for f in find_pii(text, entities, region=region)]


# --- recognisers -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("entity", "value"),
    [
        ("email", "jane.roe+news@mail.example.co.uk"),
        ("email", "o'brien_2@example.org"),
        ("phone", "+44 20 7946 0958"),
        ("phone", "(202) 555-0143"),
        ("phone", "+1-202-555-0143"),
        ("card", "4111 1111 1111 1111"),
        ("card", "4111-1111-1111-1111"),
        ("card", "4111111111111111"),
        ("card", "378282246310005"),
        ("card", "3782 822463 10005"),
        ("iban", "DE89 3704 0044 0532 0130 00"),
        ("iban", "GB82WEST12345698765432"),
        ("iban", "NO93 8601 1117 947"),
        ("ip", "192.168.1.10"),
        ("ip", "8.8.8.8"),
        ("ip", "2001:db8::8a2e:370:7334"),
        ("ip", "::ffff:192.0.2.1"),
        ("ip", "fe80::1"),
    ],
)
def test_each_entity_is_found_with_its_span(entity: str, value: str) -> None:
    text = f"Hello, please use {value}, thanks."
    start = text.index(value)
    assert find_pii(text) == [Found(entity, start, start + len(value), value)]
    assert find_pii(text, [entity]) == [Found(entity, start, start + len(value), value)]


@pytest.mark.parametrize(
    ("entity", "text"),
    [
        ("email", "mail root@localhost now"),
        ("email", "mail name@example now"),
        ("email", "mail name@example.c0m now"),
        ("email", "an @ sign and a.b@ and @c.com"),
        ("phone", "call (123) 456-7890 now"),
        ("phone", "call +1 555 123 4567 now"),
        ("phone", "call 12345 now"),
        ("card", "card 4111 1111 1111 1112 ok"),
        ("card", "card 4111 1111 1111 111 ok"),
        ("card", "order 12345678901234567890123 ok"),
        ("iban", "iban DE88 3704 0044 0532 0130 00 ok"),
        ("iban", "iban DE89 3704 0044 0532 0130 01 ok"),
        ("iban", "iban de89 3704 0044 0532 0130 00 ok"),
        ("ip", "ip 256.1.1.1 ok"),
        ("ip", "ip 01.2.3.4 ok"),
        ("ip", "version 1.2.3.4.5 ok"),
        ("ip", "version v1.2.3.4 ok"),
        ("ip", "at 12:30:45, mac 00:1A:2B:3C:4D:5E, std::vector, a :: b"),
        ("ip", "bad 2001:db8::g1 and 1:2:3:4:5:6:7:8:9"),
    ],
)
def test_near_misses_are_not_found(entity: str, text: str) -> None:
    assert find_pii(text, [entity]) == []


def test_an_iban_needs_its_countrys_length_and_a_known_country() -> None:
    good = _iban("DE", "370400440532013000")
    assert good == "DE89370400440532013000"
    assert _spans(f"to {good}.") == [("iban", good)]
    too_short = _iban("DE", "37040044053201300")  # checksum right, 21 characters
    unknown = _iban("XX", "370400440532013000")  # checksum right, no such country
    assert find_pii(f"to {too_short} or {unknown}", ["iban"]) == []
    assert len(IBAN_LENGTHS) >= 40
    assert all(15 <= n <= 34 for n in IBAN_LENGTHS.values())


def test_an_iban_check_digit_of_99_is_refused_though_mod_97_agrees() -> None:
    iban = next(i for n in range(1000) if (i := _iban("BE", f"{n:012d}"))[2:4] == "02")
    assert _spans(iban) == [("iban", iban)]
    # 99 = 2 (mod 97): the remainder still says valid, but 99 is no ISO 13616 check.
    forged = iban[:2] + "99" + iban[4:]
    assert int("".join(str(int(ch, 36)) for ch in forged[4:] + forged[:4])) % 97 == 1
    assert find_pii(forged, ["iban"]) == []


def test_a_spaced_iban_or_card_followed_by_more_digits_is_still_found() -> None:
    assert _spans("BE68 5390 0754 7034 2024") == [("iban", "BE68 5390 0754 7034")]
    assert _spans("card 4111 1111 1111 1111 123 cvv") == [("card", "4111 1111 1111 1111")]


def test_national_phone_numbers_follow_the_region() -> None:
    text = "ring 020 7946 0958 or (202) 555-0143"
    assert _spans(text, region="GB") == [("phone", "020 7946 0958")]
    assert _spans(text) == [("phone", "(202) 555-0143")]
    assert _spans(text, region="gb") == [("phone", "020 7946 0958")]
    # An unknown region finds international numbers only.
    assert _spans(text + " or +44 20 7946 0958", region="XX") == [("phone", "+44 20 7946 0958")]


def _shortest_international(metadata: phonenumbers.PhoneMetadata | None) -> int:
    assert metadata is not None and metadata.general_desc is not None
    return len(str(metadata.country_code)) + min(metadata.general_desc.possible_length)


def test_the_phone_skip_threshold_is_the_shortest_valid_international_number() -> None:
    metadata = [phonenumbers.PhoneMetadata.metadata_for_region(r)
                for r in phonenumbers.SUPPORTED_REGIONS]
    metadata += [phonenumbers.PhoneMetadata.metadata_for_nongeo_region(cc)
                 for cc in phonenumbers.COUNTRY_CODES_FOR_NON_GEO_REGIONS]
    assert PHONE_MIN_DIGITS == min(map(_shortest_international, metadata))
    assert _spans("dial +98 9601 now") == [("phone", "+98 9601")]


def test_overlaps_keep_the_earlier_start_then_the_longer_span() -> None:
    # The digits inside a spaced IBAN pass Luhn: a card alone, the IBAN when both run.
    iban = _iban("DE", "264847564696062307")
    spaced = " ".join(iban[i:i + 4] for i in range(0, len(iban), 4))
    text = f"to {spaced} ok"
    assert _spans(text, entities=["card"]) == [("card", "2648 4756 4696 0623")]
    assert _spans(text) == [("iban", spaced)]
    # Same start: the longer span wins.
    text = "write 4111111111111111@example.com"
    assert _spans(text, entities=["card"]) == [("card", "4111111111111111")]
    assert _spans(text) == [("email", "4111111111111111@example.com")]
    # A card number is not also a phone number; a "+" number that starts first is a phone.
    assert _spans("card 4111 1111 1111 1111") == [("card", "4111 1111 1111 1111")]
    text = "call +4991 4263 0324 2192"
    assert _spans(text, entities=["card"]) == [("card", "4991 4263 0324 2192")]
    assert _spans(text) == [("phone", "+4991 4263 0324 2192")]


def test_results_are_ordered_and_do_not_overlap() -> None:
    text = ("ip 10.0.0.1 mail a@example.com card 4111 1111 1111 1111 iban "
            "GB82WEST12345698765432 phone +44 20 7946 0958 end")
    found = find_pii(text)
    assert [f.entity for f in found] == ["ip", "email", "card", "iban", "phone"]
    assert all(a.end <= b.start for a, b in zip(found, found[1:], strict=False))
    assert all(text[f.start:f.end] == f.text for f in found)
    assert find_pii(text, []) == []
    assert [f.entity for f in find_pii(text, {"ip", "email"})] == ["ip", "email"]


def test_an_unknown_entity_is_a_value_error_naming_it() -> None:
    with pytest.raises(ValueError, match="'passport'"):
        find_pii("x", ["email", "passport"])
    with pytest.raises(ValueError, match="'ssn'"):
        Redactor(["ssn"])
    with pytest.raises(TypeError):
        find_pii("x", "email")
    assert ENTITIES == ("email", "phone", "card", "iban", "ip")


# --- redaction ---------------------------------------------------------------------------


def test_placeholders_are_numbered_per_entity_and_reused_across_messages() -> None:
    redactor = Redactor()
    first = redactor.redact("I am a@example.com, call +44 20 7946 0958 from 10.0.0.1.")
    second = redactor.redact("Cc b@example.com and a@example.com; card 4111 1111 1111 1111.")
    assert first == "I am <EMAIL_1>, call <PHONE_1> from <IP_1>."
    assert second == "Cc <EMAIL_2> and <EMAIL_1>; card <CARD_1>."
    assert redactor.mapping == {
        "<EMAIL_1>": "a@example.com",
        "<PHONE_1>": "+44 20 7946 0958",
        "<IP_1>": "10.0.0.1",
        "<EMAIL_2>": "b@example.com",
        "<CARD_1>": "4111 1111 1111 1111",
    }
    assert redactor.counts == {"email": 2, "phone": 1, "card": 1, "iban": 0, "ip": 1}


def test_values_are_compared_as_written() -> None:
    redactor = Redactor(["phone"])
    assert redactor.redact("(202) 555-0143 / 202-555-0143 / (202) 555-0143") == (
        "<PHONE_1> / <PHONE_2> / <PHONE_1>")


def test_mapping_and_counts_are_copies() -> None:
    redactor = Redactor(["email"])
    redactor.redact("a@example.com")
    redactor.mapping["<EMAIL_1>"] = "evil@example.com"
    redactor.counts["email"] = 9
    assert redactor.mapping == {"<EMAIL_1>": "a@example.com"}
    assert redactor.counts == {"email": 1}


def test_only_the_chosen_entities_are_redacted() -> None:
    redactor = Redactor(["email"])
    text = "a@example.com from 10.0.0.1"
    assert redactor.redact(text) == "<EMAIL_1> from 10.0.0.1"
    assert redactor.redact("nothing here") == "nothing here"


@pytest.mark.parametrize(
    "text",
    [
        "I am a@example.com, call +44 20 7946 0958 from 10.0.0.1.",
        "IBAN DE89 3704 0044 0532 0130 00, card 4111-1111-1111-1111, ip 2001:db8::1",
        "a@example.com a@example.com b@example.com <EMAIL_1> <IP_3>",
        "no personal data at all",
        "",
    ],
)
def test_restore_round_trips(text: str) -> None:
    redactor = Redactor()
    redacted = redactor.redact(text)
    assert not find_pii(redacted)
    assert Restorer(redactor.mapping).restore(redacted) == text


def test_a_typed_placeholder_not_in_the_mapping_survives_and_is_skipped() -> None:
    redactor = Redactor()
    redacted = redactor.redact("My <EMAIL_7> and <EMAIL_1> are a@example.com.")
    assert redacted == "My <EMAIL_7> and <EMAIL_1> are <EMAIL_2>."
    assert redactor.mapping == {"<EMAIL_2>": "a@example.com"}
    answer = "You wrote <EMAIL_7>, <EMAIL_1> and <EMAIL_2>."
    assert Restorer(redactor.mapping).restore(answer) == (
        "You wrote <EMAIL_7>, <EMAIL_1> and a@example.com.")
    # Numbers typed in an earlier message stay skipped.
    assert redactor.redact("b@example.com c@example.com") == "<EMAIL_3> <EMAIL_4>"
    assert redactor.redact("still <EMAIL_7>") == "still <EMAIL_7>"
    assert redactor.redact("then d@example.com") == "then <EMAIL_5>"
    assert redactor.redact("and e@example.com") == "and <EMAIL_6>"
    assert redactor.redact("and f@example.com") == "and <EMAIL_8>"


def test_a_typed_placeholder_that_is_already_minted_is_replaced_like_a_value() -> None:
    redactor = Redactor()
    assert redactor.redact("I am a@example.com") == "I am <EMAIL_1>"
    second = redactor.redact("Literally type <EMAIL_1> please, and <EMAIL_1> again")
    assert second == "Literally type <EMAIL_2> please, and <EMAIL_2> again"
    assert redactor.mapping == {"<EMAIL_1>": "a@example.com", "<EMAIL_2>": "<EMAIL_1>"}
    assert redactor.counts["email"] == 1
    restorer = Restorer(redactor.mapping)
    # Restored once: the literal comes back as typed, not as the address.
    assert restorer.restore("<EMAIL_1> typed <EMAIL_2>") == "a@example.com typed <EMAIL_1>"


def test_values_inside_a_typed_placeholder_are_left_alone() -> None:
    redactor = Redactor()
    text = "see <CARD_4111111111111111> and <PHONE_2025550143>"
    assert redactor.redact(text) == text
    assert redactor.redact("now 4111 1111 1111 1111") == "now <CARD_1>"


PIECES = ["a@example.com", "b@example.org", "+44 20 7946 0958", "(202) 555-0143",
          "4111 1111 1111 1111", "DE89 3704 0044 0532 0130 00", "10.0.0.1", "2001:db8::1",
          "<EMAIL_1>", "<EMAIL_2>", "<PHONE_1>", "<IP_3>", "<EMA", "IL_1>", "<", ">", "_",
          " ", ", ", "word", "1", "."]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.sampled_from(PIECES), max_size=12), min_size=1, max_size=3))
def test_any_messages_round_trip_and_typed_placeholders_never_get_a_value(
    messages: list[list[str]],
) -> None:
    redactor = Redactor()
    texts = ["".join(pieces) for pieces in messages]
    redacted = [redactor.redact(text) for text in texts]
    restorer = Restorer(redactor.mapping)
    # A minted placeholder left where the user typed it would be restored to its value,
    # so the exact round trip shows every one stands only where the redactor put it.
    for text, out in zip(texts, redacted, strict=True):
        assert restorer.restore(out) == text


def test_only_exact_placeholders_are_restored() -> None:
    restorer = Restorer({"<EMAIL_1>": "a@example.com"})
    altered = "<Email_1> <EMAIL 1> EMAIL_1 <EMAIL_1 > <EMAIL_10> <<EMAIL_1>>"
    assert restorer.restore(altered) == (
        "<Email_1> <EMAIL 1> EMAIL_1 <EMAIL_1 > <EMAIL_10> <a@example.com>")


# --- streaming ---------------------------------------------------------------------------

MAPPING = {"<EMAIL_1>": "a@example.com", "<PHONE_12>": "+44 20 7946 0958", "<IP_1>": "::1"}
ANSWER = "Mail <EMAIL_1> or ring <PHONE_12>; not <EMAIL_2>, <PHONE_1> or <IP_1"


def _stream(restorer: Restorer, chunks: list[str]) -> str:
    longest = max(map(len, MAPPING), default=1)
    out = []
    for chunk in chunks:
        out.append(restorer.feed(chunk))
        assert restorer.held <= max(longest - 1, 0)
    out.append(restorer.flush())
    assert restorer.held == 0
    return "".join(out)


def test_every_split_point_streams_like_a_whole_restore() -> None:
    whole = Restorer(MAPPING).restore(ANSWER)
    assert whole == ("Mail a@example.com or ring +44 20 7946 0958; "
                     "not <EMAIL_2>, <PHONE_1> or <IP_1")
    for i in range(len(ANSWER) + 1):
        assert _stream(Restorer(MAPPING), [ANSWER[:i], ANSWER[i:]]) == whole, i
        for j in range(i, len(ANSWER) + 1, 7):
            chunks = [ANSWER[:i], ANSWER[i:j], ANSWER[j:]]
            assert _stream(Restorer(MAPPING), chunks) == whole, (i, j)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(ANSWER)), max_size=12))
def test_any_chunking_streams_like_a_whole_restore(cuts: list[int]) -> None:
    bounds = [0, *sorted(cuts), len(ANSWER)]
    chunks = [ANSWER[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    assert _stream(Restorer(MAPPING), chunks) == Restorer(MAPPING).restore(ANSWER)


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(st.text("ab<>", min_size=1, max_size=4), st.text("xyz", max_size=3),
                    max_size=4),
    st.text("ab<>x", max_size=30),
    st.lists(st.integers(min_value=0, max_value=30), max_size=8),
)
def test_streaming_equals_restore_for_any_keys(
    mapping: dict[str, str], text: str, cuts: list[int]
) -> None:
    # Keys that are prefixes or overlaps of each other: the hold-back still never changes
    # which placeholders a whole restore would replace.
    restorer = Restorer(mapping)
    bounds = [0, *sorted(min(c, len(text)) for c in cuts), len(text)]
    out = []
    for a, b in zip(bounds, bounds[1:], strict=False):
        out.append(restorer.feed(text[a:b]))
        assert restorer.held <= max(max(map(len, mapping), default=0) - 1, 0)
    out.append(restorer.flush())
    assert "".join(out) == Restorer(mapping).restore(text)


def test_a_split_placeholder_is_held_then_restored_whole() -> None:
    restorer = Restorer(MAPPING)
    assert restorer.feed("Hi <EMA") == "Hi "
    assert restorer.held == len("<EMA")
    assert restorer.feed("IL_1") == ""
    assert restorer.held == len("<EMAIL_1")
    assert restorer.feed("> bye <") == "a@example.com bye "
    assert restorer.held == 1
    assert restorer.feed("b>") == "<b>"
    assert restorer.feed("end <EM") == "end "
    assert restorer.flush() == "<EM"
    assert restorer.flush() == ""


def test_the_hold_back_is_bounded_by_the_longest_placeholder() -> None:
    restorer = Restorer(MAPPING)
    longest = max(map(len, MAPPING))
    for ch in "<PHONE_12" + "x" * 5:
        restorer.feed(ch)
        assert restorer.held <= longest - 1
    assert restorer.held == 0


def test_an_empty_mapping_streams_text_at_once() -> None:
    restorer = Restorer({})
    assert restorer.feed("<EMA") == "<EMA"
    assert restorer.held == 0
    assert restorer.feed("IL_1>") == "IL_1>"
    assert restorer.restore("<EMAIL_1>") == "<EMAIL_1>"
    assert restorer.flush() == ""


def test_an_empty_placeholder_is_refused() -> None:
    with pytest.raises(ValueError):
        Restorer({"": "x"})
