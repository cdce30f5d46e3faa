"""Personal data: each recogniser finds its values with the right spans and leaves their
near-misses alone (bad checksums, impossible addresses, version strings); overlaps keep
one value; an unknown entity is an error naming it."""

from __future__ import annotations

from collections.abc import Collection

import phonenumbers
import pytest

from conveyor.policy.pii import Redactor
from conveyor.policy.recognisers import _PHONE_MIN_INTERNATIONAL_DIGITS as PHONE_MIN_DIGITS
from conveyor.policy.recognisers import (
    ENTITIES,
    IBAN_LENGTHS,
    Found,
    checked_entities,
    find_checked,
)


def find_pii(text: str, entities: Collection[str] = ENTITIES, *,
             region: str = "US") -> list[Found]:
    """What a Redactor of ``entities`` finds in ``text``."""
    return find_checked(text, checked_entities(entities), region.upper())


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
