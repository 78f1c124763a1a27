"""Key layout and the strict key-component codec (spec §2.4)."""

from __future__ import annotations

from urllib.parse import quote

import pytest
from hypothesis import given
from hypothesis import strategies as st

from weft_sync import keys


def test_encoding_follows_encode_uri_component() -> None:
    assert keys.encode_key_component("a-_.!~*'()Z9") == "a-_.!~*'()Z9"
    assert keys.encode_key_component("a b/c:d%e+f") == "a%20b%2Fc%3Ad%25e%2Bf"
    assert keys.encode_key_component("é") == "%C3%A9"
    assert keys.encode_key_component("😀") == "%F0%9F%98%80"


def test_lone_surrogate_cannot_be_encoded() -> None:
    with pytest.raises(ValueError, match="lone surrogate"):
        keys.encode_key_component("a\ud800")


@pytest.mark.parametrize("bad", ["%", "%4", "%zz", "abc%E0%A4%A", "%C3", "%FF", "%ED%A0%80"])
def test_malformed_components_are_rejected(bad: str) -> None:
    assert keys.try_decode_key_component(bad) is None
    with pytest.raises(ValueError, match="malformed key component"):
        keys.decode_key_component(bad)


def test_decoding_is_strict_but_keeps_plus_and_lowercase_hex() -> None:
    assert keys.decode_key_component("a+b") == "a+b"
    assert keys.decode_key_component("%c3%a9") == "é"
    assert keys.decode_key_component("plain") == "plain"


@given(st.text(alphabet=st.sampled_from("aZ09-_.!~*'() %/:+é\u00a0\n😀")) | st.text())
def test_encoding_agrees_with_quote_on_any_text(text: str) -> None:
    # The verbatim shortcut must give what quote() gives (the reference encoding).
    try:
        expected = quote(text, safe="-_.!~*'()", encoding="utf-8", errors="strict")
    except UnicodeEncodeError:
        with pytest.raises(ValueError, match="lone surrogate"):
            keys.encode_key_component(text)
        return
    assert keys.encode_key_component(text) == expected


@given(st.text())
def test_components_round_trip(text: str) -> None:
    try:
        encoded = keys.encode_key_component(text)
    except ValueError:
        assert any(0xD800 <= ord(c) <= 0xDFFF for c in text)
        return
    assert encoded.isascii()
    assert keys.decode_key_component(encoded) == text


def test_key_builders_and_prefixes() -> None:
    wid = "workflow:with:colons/and%percent"
    enc = "workflow%3Awith%3Acolons%2Fand%25percent"
    assert keys.workflow_owner_epoch(wid) == "wf-owner-epoch:" + enc
    assert keys.workflow_owner_holder(wid) == "wf-owner-holder:" + enc
    assert keys.workflow(wid) == "wf:" + enc
    assert keys.workflow_status_index("running", wid) == "wf-idx-status:running:" + enc
    assert keys.workflow_owner_holder("") == "wf-owner-holder:"
    assert keys.workflow_status_index("running", "") == "wf-idx-status:running:"
    assert keys.OWNERSHIP_MODE_MARKER == "ownership-mode-marker"


@pytest.mark.parametrize(
    ("bad", "exc", "match"),
    [
        ("", ValueError, "non-empty"),
        ("a\udc00", ValueError, "lone surrogate"),
        ("x" * 1025, ValueError, "limit is 1024"),
        (5, TypeError, "must be str"),
    ],
)
def test_invalid_workflow_ids_are_named(bad: object, exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        keys.validate_workflow_id(bad)


def _canonical_by_definition(component: str) -> str | None:
    decoded = keys.try_decode_key_component(component)
    if decoded is None or keys.encode_key_component(decoded) != component:
        return None
    return decoded


@pytest.mark.parametrize(
    ("component", "expected"),
    [
        ("wf-0001", "wf-0001"),
        ("a-_.!~*'()Z9", "a-_.!~*'()Z9"),
        ("", ""),
        ("a%20b%2Fc", "a b/c"),
        ("%C3%A9", "é"),
        ("%c3%a9", None),  # lowercase hex decodes but is not what the encoder writes
        ("%41", None),  # a needless escape
        ("a b", None),  # a character the encoder escapes
        ("job:ckpt", None),  # a related record under the same prefix
        ("é", None),
        ("%zz", None),
    ],
)
def test_canonical_components_decode_and_others_do_not(
    component: str, expected: str | None
) -> None:
    assert keys.decode_canonical_component(component) == expected
    assert _canonical_by_definition(component) == expected


@given(st.text())
def test_canonical_decoding_agrees_with_decode_then_encode(text: str) -> None:
    # Any string as a component, and the encoding of any encodable string.
    assert keys.decode_canonical_component(text) == _canonical_by_definition(text)
    try:
        encoded = keys.encode_key_component(text)
    except ValueError:
        return
    assert keys.decode_canonical_component(encoded) == text
