"""Bad input: fuzzed decoders, URLs, durations, workflow ids, table names and batch values.

Decoders of stored bytes fail closed (a value or ``None``; the raising ones raise ``ValueError``
only). Every public entry point refuses malformed input with ``ValueError``/``TypeError`` naming
the problem before it touches the store, and a batch holding one bad value writes nothing.
"""

from __future__ import annotations

import os
import re
import sqlite3
from collections.abc import Callable, Iterator
from datetime import timedelta
from fractions import Fraction
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import msgpack
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from tests.reliability.faulty import FaultyStorage
from weft_sync import keys
from weft_sync.claims import ClaimRegistry
from weft_sync.clock import ManualClock
from weft_sync.codec import (
    EPOCH_MAX,
    SAFE_INT_MAX,
    HolderRecord,
    decode_epoch,
    decode_holder,
    decode_mode_marker,
    decode_workflow_record,
    encode_epoch,
    encode_holder,
    encode_mode_marker,
    encode_workflow_record,
    try_decode_workflow_record,
)
from weft_sync.errors import StorageError
from weft_sync.options import MAX_CLAIM_TTL_MS, OwnershipOptions, parse_duration
from weft_sync.storage import (
    Condition,
    Delete,
    Operation,
    Put,
    SqliteStorage,
    Storage,
    open_storage,
)
from weft_sync.storage.sqlite.identity import RESERVED_TABLES

FUZZ = settings(max_examples=200, deadline=None)
FUZZ_WITH_FIXTURES = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
TTL_MS = 30_000
RENEW_MS = 5_000
TABLE_INJECTIONS = (
    'weft_kv"; DROP TABLE weft_kv; --',
    "weft_kv; DELETE FROM weft_kv",
    "t' OR '1'='1",
    "a b",
    "kv)--",
    '"quoted"',
    "",
    "1starts_with_digit",
    "x" * 64,
    "tablé",
)

# -- values MessagePack can carry ---------------------------------------------------------------

EDGE_INTS = (0, 1, -1, 2, EPOCH_MAX, EPOCH_MAX + 1, SAFE_INT_MAX, SAFE_INT_MAX + 1, 2**63, -(2**63))
edge_values = st.one_of(
    st.sampled_from(EDGE_INTS),
    st.sampled_from([None, True, False, 1.5, 1.0, float("nan"), 1e20, "", "7", "lease"]),
    st.sampled_from(["workflow-lease", "running", "engine-a", b"engine-a", [1], {"a": 1}]),
    st.integers(-(2**63), 2**64 - 1),
    st.text(max_size=8),
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(),
    st.text(max_size=12),
    st.binary(max_size=12),
    st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=12)),
    st.builds(msgpack.Timestamp, st.integers(-(2**40), 2**40), st.integers(0, 999_999_999)),
)
packable = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.one_of(st.text(max_size=12), st.integers(-5, 5)), inner, max_size=5),
    ),
    max_leaves=12,
)


def _near_map(fields: tuple[str, ...]) -> st.SearchStrategy[bytes]:
    """MessagePack maps with (some of) ``fields``, edge values, and stray extra keys."""
    body = st.fixed_dictionaries(
        {},
        optional={name: edge_values for name in fields}
        | {"extra": packable, "engine_id ": edge_values},
    )
    return body.map(lambda d: msgpack.packb(d, use_bin_type=True))


def _packed(value: object) -> bytes:
    packed: bytes = msgpack.packb(value, use_bin_type=True)
    return packed


stored_bytes = st.one_of(
    st.binary(max_size=64),
    packable.map(_packed),
    _near_map(("engine_id", "epoch", "expires_at", "claimed_at")),
    _near_map(("mode", "established_at")),
    _near_map(("workflow_id", "type", "status", "created_at", "updated_at", "revision", "input")),
    # Valid records with junk after them, and truncated ones.
    st.builds(lambda b, junk: b + junk, packable.map(_packed), st.binary(min_size=1, max_size=4)),
    packable.map(_packed).map(lambda b: b[: max(0, len(b) - 1)]),
)


# -- decoders -------------------------------------------------------------------------------


@FUZZ
@given(stored_bytes)
@example(b"\x00" * 7)
@example(b"\xff" * 8)
@example(encode_epoch(EPOCH_MAX))
@example(b"\xdd\xff\xff\xff\xff")  # an array header claiming 4 G elements
@example(b"\xc7\x00\xff")  # a malformed timestamp extension
def test_decoders_of_stored_bytes_return_a_valid_value_or_none(raw: bytes) -> None:
    epoch = decode_epoch(raw)
    assert epoch is None or (type(epoch) is int and 1 <= epoch <= EPOCH_MAX)
    if epoch is not None:
        assert encode_epoch(epoch) == raw

    holder = decode_holder(raw)
    if holder is not None:
        assert isinstance(holder.engine_id, str) and holder.engine_id
        assert type(holder.epoch) is int and 1 <= holder.epoch <= EPOCH_MAX
        for stamp in (holder.expires_at, holder.claimed_at):
            assert type(stamp) is int and 0 <= stamp <= SAFE_INT_MAX
        # A decoded record re-encodes to bytes that decode to the same record.
        assert decode_holder(encode_holder(holder)) == holder

    marker = decode_mode_marker(raw)
    if marker is not None:
        assert marker.mode in ("lease", "workflow-lease")
        assert type(marker.established_at) is int and 0 <= marker.established_at <= SAFE_INT_MAX
        assert decode_mode_marker(encode_mode_marker(marker)) == marker

    record = try_decode_workflow_record(raw)
    try:
        strict = decode_workflow_record(raw)
    except ValueError:
        assert record is None
    else:
        assert record is not None
        fields = ("workflow_id", "type", "status", "created_at", "updated_at", "revision")
        assert [getattr(strict, f) for f in fields] == [getattr(record, f) for f in fields]
        assert isinstance(strict.workflow_id, str) and strict.workflow_id
        assert isinstance(strict.status, str) and strict.status


@FUZZ
@given(st.one_of(st.none(), st.text(max_size=8), st.integers(), st.lists(st.integers(0, 255))))
def test_fail_closed_decoders_return_none_for_values_that_are_not_bytes(value: Any) -> None:
    assert decode_epoch(value) is None
    assert decode_holder(value) is None
    assert decode_mode_marker(value) is None
    assert try_decode_workflow_record(value) is None


key_component_text = st.one_of(
    st.text(),
    st.lists(
        st.one_of(
            st.sampled_from(["%", "%2", "%G0", "%41", "%e0%a4", "%E0%A4%A", "%C3%A9", "%ff", "+"]),
            st.text(max_size=4),
            st.from_regex(r"%[0-9A-Fa-f]{2}", fullmatch=True),
        ),
        max_size=8,
    ).map("".join),
)


@FUZZ
@given(key_component_text)
def test_key_component_decoders_return_text_or_refuse_with_value_error(s: str) -> None:
    lenient = keys.try_decode_key_component(s)
    assert lenient is None or isinstance(lenient, str)
    try:
        strict = keys.decode_key_component(s)
    except ValueError as exc:
        assert lenient is None
        assert "malformed key component" in str(exc)
    else:
        assert strict == lenient


@FUZZ
@given(st.text())
def test_key_components_round_trip_and_encode_to_safe_ascii(s: str) -> None:
    try:
        encoded = keys.encode_key_component(s)
    except ValueError as exc:
        assert "surrogate" in str(exc)
        with pytest.raises(UnicodeEncodeError):
            s.encode("utf-8")
        return
    assert encoded.isascii()
    assert all(c.isalnum() or c in "-_.!~*'()%" for c in encoded)
    assert keys.decode_key_component(encoded) == s
    assert keys.try_decode_key_component(encoded) == s


# -- durations and options ----------------------------------------------------------------------

UNITS = {"ms": 1, "s": 1_000, "m": 60_000, "h": 3_600_000}
well_formed_durations = st.from_regex(r"\A ?[0-9]{1,7}(\.[0-9]{1,4})? ?(ms|s|m|h) ?\Z")
durations = st.one_of(
    well_formed_durations,
    st.text(max_size=12),
    st.integers(-(10**15), 10**15),
    st.timedeltas(min_value=timedelta(days=-2), max_value=timedelta(days=2)),
    st.sampled_from([None, True, 1.5, b"30s", "30", "1e3s", "-5s", "+5s", "5 sec", "∞s"]),
)


@FUZZ
@given(well_formed_durations)
def test_well_formed_durations_parse_to_exact_milliseconds_or_refuse_fractions(text: str) -> None:
    match = re.fullmatch(r" ?([0-9.]+) ?([a-z]+) ?", text)
    assert match is not None
    exact = Fraction(match.group(1)) * UNITS[match.group(2)]
    if exact.denominator == 1:
        assert parse_duration(text) == exact
    else:
        with pytest.raises(ValueError, match="whole number of milliseconds"):
            parse_duration(text)


@FUZZ
@given(durations)
def test_parse_duration_returns_non_negative_ms_or_refuses(value: Any) -> None:
    try:
        parsed = parse_duration(value)
    except (ValueError, TypeError) as exc:
        assert str(exc)
        return
    assert type(parsed) is int and parsed >= 0
    if isinstance(value, timedelta):
        assert timedelta(milliseconds=parsed) == value


@FUZZ
@given(durations, durations)
def test_ownership_options_are_valid_once_constructed(ttl: Any, renew: Any) -> None:
    try:
        options = OwnershipOptions(claim_ttl=ttl, claim_renew_interval=renew)
    except (ValueError, TypeError) as exc:
        assert str(exc)
        try:
            ttl_ms, renew_ms = parse_duration(ttl), parse_duration(renew)
        except (ValueError, TypeError):
            return
        # Both parse, so the pair itself must break a safety rule.
        assert (
            renew_ms <= 0
            or renew_ms >= ttl_ms
            or ttl_ms < 3 * renew_ms
            or ttl_ms > MAX_CLAIM_TTL_MS
        )
        return
    assert 0 < options.claim_renew_interval_ms < options.claim_ttl_ms
    assert options.claim_ttl_ms >= 3 * options.claim_renew_interval_ms


def test_a_claim_ttl_too_large_for_a_holder_record_is_refused_by_the_options() -> None:
    with pytest.raises(ValueError, match="claim_ttl"):
        OwnershipOptions(claim_ttl=SAFE_INT_MAX + 1, claim_renew_interval="5s")


# -- storage URLs ---------------------------------------------------------------------------

url_pieces = st.sampled_from(
    ["a", "b.db", "/", "//", ".", "?", "&", "=", "#", "%", "%2F", "%00", ":", "@", "[", "]", "\\",
     " ", "\x00", "\ud800", "é", "table", "busy_timeout_ms", "synchronous", "min_size", "FULL",
     "NORMAL", "off", "-1", "99999999999999999999", "1e3", "weft_kv", 'x"; DROP TABLE t; --']
)  # fmt: skip
sqlite_urls = st.builds(
    lambda scheme, rest: scheme + "".join(rest),
    st.sampled_from(["sqlite://", "SQLITE://", "sqlite:///", "sqlite:///d/", "sqlite:", "sqlite"]),
    st.lists(url_pieces, max_size=10),
)


def _creates_files_outside_cwd(url: str) -> bool:
    """Whether opening ``url`` could create a file outside the working directory."""
    scheme, sep, _ = url.partition("://")
    if scheme.lower() in ("postgres", "postgresql"):
        return True  # would try to connect somewhere
    if not sep or scheme.lower() != "sqlite":
        return False
    try:
        parts = urlsplit(url)
    except ValueError:
        return False  # open_storage refuses it before touching the file system
    path = parts.path[1:] if parts.path.startswith("/") else parts.path
    return os.path.isabs(path) or ".." in Path(path).parts


@pytest.fixture
def in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.chdir(tmp_path)
    yield tmp_path


@settings(FUZZ_WITH_FIXTURES, max_examples=300, database=None)
@given(st.one_of(st.text(max_size=30), sqlite_urls))
@example("sqlite:///store.db?table=" + quote('x"; DROP TABLE t; --'))
@example("sqlite:///store.db?busy_timeout_ms=-1")
@example("sqlite:///store.db?synchronous=off&table=ok")
@example("sqlite:///store.db?table=a&table=b")
@example("sqlite:///store.db?unknown=1")
@example("sqlite://host/store.db")
@example("sqlite://[")
@example("mysql://x")
def test_open_storage_opens_a_file_under_cwd_or_refuses_with_value_or_type_error(
    in_tmp_path: Path, url: str
) -> None:
    assume(not _creates_files_outside_cwd(url))
    try:
        store = open_storage(url)
    except (ValueError, TypeError) as exc:
        assert str(exc)
        return
    except StorageError as exc:
        # A well-formed URL whose path the file system refuses (a directory, a missing parent).
        assert url.lower().startswith("sqlite://"), url
        assert "SQLite open failed" in str(exc)
        return
    try:
        assert isinstance(store, SqliteStorage)
        assert Path(store.path).resolve().is_relative_to(in_tmp_path.resolve())
        store.put("k", b"v")
        assert store.get("k") == b"v"
    finally:
        store.close()


@pytest.mark.parametrize("value", [None, b"sqlite:///x.db", 5, Path("x.db")])
def test_open_storage_refuses_a_url_that_is_not_a_string(value: Any) -> None:
    with pytest.raises(TypeError, match="URL string"):
        open_storage(value)


@pytest.mark.parametrize("path", ["a\x00b.db", "a\ud800b.db"])
def test_open_storage_names_the_url_when_its_path_cannot_be_a_file_name(
    in_tmp_path: Path, path: str
) -> None:
    with pytest.raises(ValueError, match="storage URL"):
        open_storage(f"sqlite:///{path}")


# -- table names ----------------------------------------------------------------------------


def _sqlite_tables(path: Path) -> set[str]:
    with sqlite3.connect(path) as conn:
        rows = conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
        # weft_open_paths: the paths engines have the file open through (one per file).
        return {row[0] for row in rows} - {"weft_open_paths"}


@pytest.mark.parametrize("table", TABLE_INJECTIONS)
def test_sqlite_storage_refuses_a_table_name_with_sql_in_it(tmp_path: Path, table: str) -> None:
    with SqliteStorage(tmp_path / "store.db", table="weft_kv") as store:
        store.put("k", b"v")
    with pytest.raises(ValueError, match="invalid table name") as info:
        SqliteStorage(tmp_path / "store.db", table=table)
    assert repr(table)[:30] in str(info.value)
    assert _sqlite_tables(tmp_path / "store.db") == {"weft_kv"}
    with pytest.raises(ValueError, match="invalid table name"):
        open_storage(f"sqlite:///{tmp_path / 'store.db'}?table={quote(table)}")
    with SqliteStorage(tmp_path / "store.db", table="weft_kv") as store:
        assert store.get("k") == b"v"
    assert not (tmp_path / "other.db").exists()
    with pytest.raises(ValueError):
        SqliteStorage(tmp_path / "other.db", table=table)
    assert not (tmp_path / "other.db").exists()


@pytest.mark.parametrize("table", [None, 5, b"weft_kv"])
def test_sqlite_storage_refuses_a_table_name_that_is_not_a_string(
    tmp_path: Path, table: Any
) -> None:
    with pytest.raises(ValueError, match="invalid table name"):
        SqliteStorage(tmp_path / "store.db", table=table)


@pytest.mark.parametrize("table", ["select", "order", "TABLE", "_"])
def test_sqlite_storage_quotes_table_names_that_are_sql_keywords(
    tmp_path: Path, table: str
) -> None:
    with SqliteStorage(tmp_path / "store.db", table=table) as store:
        store.put("k", b"v")
        assert store.conditional_batch([Condition("k", b"v")], [Delete("k")])
        assert store.get("k") is None


@settings(FUZZ_WITH_FIXTURES, max_examples=80)
@given(st.one_of(st.text(max_size=70), st.from_regex(r"\A[A-Za-z_][A-Za-z0-9_]{0,70}\Z")))
@example("WEFT_OPEN_PATHS")
@example("weft_kv")
def test_sqlite_table_names_are_accepted_exactly_when_they_are_plain_identifiers(
    tmp_path: Path, table: str
) -> None:
    assume(not table.lower().startswith("sqlite_"))  # see the reserved-prefix test below
    plain = table.isascii() and table.replace("_", "a").isalnum() and not table[:1].isdigit()
    acceptable = plain and 1 <= len(table) <= 63 and table.lower() not in RESERVED_TABLES
    if not acceptable:
        with pytest.raises(ValueError, match="invalid table name"):
            SqliteStorage(tmp_path / "fuzz.db", table=table)
        return
    with SqliteStorage(tmp_path / "fuzz.db", table=table, synchronous="NORMAL") as store:
        store.put("k", table.encode())
        assert store.get("k") == table.encode()


@pytest.mark.parametrize("table", ["sqlite_kv", "SQLITE_master"])
def test_sqlite_storage_refuses_a_reserved_table_name_up_front(tmp_path: Path, table: str) -> None:
    with pytest.raises(ValueError, match="table"):
        SqliteStorage(tmp_path / "store.db", table=table)


@pytest.mark.parametrize("table", ["weft_open_paths", "WEFT_OPEN_PATHS", "Weft_Open_Paths"])
def test_sqlite_storage_refuses_the_name_of_its_own_paths_table(tmp_path: Path, table: str) -> None:
    """The store keeps its open paths in a table of its file; a store table of that name (in any
    case: SQLite compares names without it) would be that table, so it is refused up front, by
    the constructor and by a URL, before any file is created."""
    with pytest.raises(ValueError, match=f"invalid table name '{table}'.*keeps a table"):
        SqliteStorage(tmp_path / "store.db", table=table)
    with pytest.raises(ValueError, match=f"invalid table name '{table}'"):
        open_storage(f"sqlite:///{tmp_path / 'url.db'}?table={table}")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("table", TABLE_INJECTIONS)
def test_postgres_storage_refuses_a_table_name_with_sql_in_it(
    postgres_base_url: str, table: str
) -> None:
    from weft_sync.storage.postgres.store import PostgresStorage

    with pytest.raises(ValueError, match="invalid table name"):
        PostgresStorage(postgres_base_url, table=table)
    sep = "&" if "?" in postgres_base_url else "?"
    with pytest.raises(ValueError, match="invalid table name"):
        open_storage(f"{postgres_base_url}{sep}table={quote(table)}")


# -- workflow ids at every registry method ------------------------------------------------------

BAD_WORKFLOW_IDS: list[tuple[Any, type[Exception], str]] = [
    ("", ValueError, "non-empty"),
    ("wf-\ud800", ValueError, "surrogate"),
    ("\udfff", ValueError, "surrogate"),
    ("w" * 1025, ValueError, "1024"),
    (None, TypeError, "must be str"),
    (42, TypeError, "must be str"),
    (b"wf-1", TypeError, "must be str"),
    (["wf-1"], TypeError, "must be str"),
]

RegistryCall = Callable[[ClaimRegistry, Any], object]
REGISTRY_METHODS: dict[str, RegistryCall] = {
    "acquire": lambda r, wid: r.acquire(wid),
    "renew": lambda r, wid: r.renew(wid),
    "renew_many": lambda r, wid: r.renew_many([wid]),
    "renew_many among valid ids": lambda r, wid: r.renew_many(["wf-ok", wid, "wf-ok-2"]),
    "renew_many_outcomes": lambda r, wid: r.renew_many_outcomes(["wf-ok", wid]),
    "release": lambda r, wid: r.release(wid),
    "release with epoch": lambda r, wid: r.release(wid, expected_epoch=1),
    "takeover": lambda r, wid: r.takeover(wid),
    "prepare_acquire_fragment": lambda r, wid: r.prepare_acquire_fragment(wid),
    "record_folded_acquire": lambda r, wid: r.record_folded_acquire(
        wid, r.prepare_acquire_fragment("wf-ok")
    ),
    "forget_local_claim": lambda r, wid: r.forget_local_claim(wid),
    "current_epoch": lambda r, wid: r.current_epoch(wid),
    "current_epoch_bytes": lambda r, wid: r.current_epoch_bytes(wid),
}


@pytest.fixture
def counted(tmp_path: Path) -> Iterator[FaultyStorage]:
    """A SQLite store behind a wrapper that counts calls and injects no fault.

    Workflow ids are validated before any I/O, so one backend suffices here.
    """
    with SqliteStorage(tmp_path / "ids.db", synchronous="NORMAL") as store:
        yield FaultyStorage(store, rate=0.0)


@pytest.fixture
def registry(counted: FaultyStorage) -> ClaimRegistry:
    return ClaimRegistry(
        counted,
        engine_id="engine-a",
        clock=ManualClock(1_000),
        claim_ttl_ms=TTL_MS,
        claim_renew_interval_ms=RENEW_MS,
    )


@pytest.mark.parametrize("method", list(REGISTRY_METHODS))
def test_every_registry_method_refuses_an_invalid_workflow_id_before_touching_the_store(
    registry: ClaimRegistry, counted: FaultyStorage, method: str
) -> None:
    assert registry.acquire("wf-held").status == "acquired"
    for bad_id, error, fragment in BAD_WORKFLOW_IDS:
        before = counted.total_calls
        with pytest.raises(error, match=fragment):
            REGISTRY_METHODS[method](registry, bad_id)
        # Only the valid preparation handed to record_folded_acquire read the store.
        assert counted.total_calls == before + (method == "record_folded_acquire"), bad_id
    assert registry.list_held_workflow_ids() == ["wf-held"]
    assert registry.renew("wf-held").status == "renewed"


def test_renew_many_refuses_a_single_string_instead_of_renewing_its_characters(
    registry: ClaimRegistry,
) -> None:
    with pytest.raises(TypeError):
        registry.renew_many("wf-1")


@pytest.mark.parametrize("expected_epoch", ["1", 1.0, True])
def test_release_refuses_an_expected_epoch_that_is_not_an_int(
    registry: ClaimRegistry, expected_epoch: Any
) -> None:
    assert registry.acquire("wf-1").status == "acquired"
    with pytest.raises(TypeError, match="expected_epoch"):
        registry.release("wf-1", expected_epoch=expected_epoch)
    assert registry.current_epoch("wf-1") == 1


def _is_valid_workflow_id(wid: str) -> bool:
    """The documented rule, written independently of the code under test.

    Non-empty, at most 1,024 characters, and valid Unicode (no lone surrogate).
    """
    return 0 < len(wid) <= 1024 and not any(0xD800 <= ord(ch) <= 0xDFFF for ch in wid)


@settings(FUZZ_WITH_FIXTURES, max_examples=100)
@given(
    st.one_of(
        # Surrogates included: the default text strategy never draws one.
        st.text(alphabet=st.characters(blacklist_categories=()), max_size=20),
        st.sampled_from(["x" * 1024, "x" * 1025, "\u00e9" * 1024, "a\ud800b", ""]),
    )
)
def test_any_valid_text_works_as_a_workflow_id(registry: ClaimRegistry, wid: str) -> None:
    if not _is_valid_workflow_id(wid):
        with pytest.raises(ValueError):
            registry.current_epoch(wid)
        with pytest.raises(ValueError):
            registry.acquire(wid)
        return
    if registry.current_epoch(wid) is None:
        assert registry.acquire(wid).status == "acquired"
    assert registry.renew(wid).status == "renewed"
    assert registry.release(wid).status == "released"


# -- bad values never corrupt stored data -------------------------------------------------------

# Untyped aliases: the bad values below are deliberate.
AnyPut: Any = Put
AnyDelete: Any = Delete
AnyCondition: Any = Condition

BAD_OPERATIONS: list[tuple[Any, type[Exception]]] = [
    (AnyPut("bad", "not bytes"), TypeError),
    (AnyPut("bad", None), TypeError),
    (AnyPut("bad", 5), TypeError),
    (AnyPut("bad", ["b"]), TypeError),
    (AnyPut(5, b"v"), TypeError),
    (AnyPut("bad\x00key", b"v"), ValueError),
    (AnyPut("bad\ud800", b"v"), ValueError),
    (AnyDelete(None), TypeError),
    (("put", "bad", b"v"), TypeError),
    (None, TypeError),
]


def _snapshot(store: Storage) -> list[tuple[str, bytes]]:
    return store.scan("")


@pytest.mark.parametrize(("bad", "error"), BAD_OPERATIONS)
def test_a_batch_with_one_bad_operation_writes_nothing(
    storage: Storage, bad: Any, error: type[Exception]
) -> None:
    storage.put("keep", b"old")
    before = _snapshot(storage)
    good: list[Operation] = [Put("new", b"1"), Put("keep", b"overwritten"), Delete("keep")]
    attempts: list[Callable[[], object]] = [
        lambda: storage.batch([*good, bad]),
        lambda: storage.batch([bad, *good]),
        lambda: storage.conditional_batch([], [*good, bad]),
        lambda: storage.conditional_batch([Condition("keep", b"old")], [*good, bad]),
        lambda: storage.conditional_batches([([], good), ([Condition("keep", b"old")], [bad])]),
        lambda: storage.conditional_batches([([], [bad]), ([], good)]),
    ]
    for attempt in attempts:
        with pytest.raises(error):
            attempt()
        assert _snapshot(storage) == before


@pytest.mark.parametrize(
    ("condition", "error"),
    [
        (AnyCondition("keep", "old"), TypeError),
        (AnyCondition("keep", 0), TypeError),
        (AnyCondition(None, None), TypeError),
        (AnyCondition("k\x00", None), ValueError),
        (("keep", b"old"), TypeError),
    ],
)
def test_a_conditional_batch_with_a_bad_condition_writes_nothing(
    storage: Storage, condition: Any, error: type[Exception]
) -> None:
    storage.put("keep", b"old")
    before = _snapshot(storage)
    with pytest.raises(error):
        storage.conditional_batch([Condition("keep", b"old"), condition], [Delete("keep")])
    with pytest.raises(error):
        storage.conditional_batches([([], [Put("new", b"1")]), ([condition], [])])
    assert _snapshot(storage) == before


@pytest.mark.parametrize("value", ["text", None, 1, 1.5, [b"v"], {"v": 1}])
def test_put_of_a_value_that_is_not_bytes_keeps_the_stored_value(
    storage: Storage, value: Any
) -> None:
    storage.put("k", b"old")
    with pytest.raises(TypeError, match="must be bytes"):
        storage.put("k", value)
    assert storage.get("k") == b"old"


fuzz_keys = st.sampled_from(["fz/a", "fz/b", "fz/c"])
good_ops = st.one_of(
    st.builds(Put, fuzz_keys, st.binary(max_size=8)),
    st.builds(Delete, fuzz_keys),
)
bad_ops = st.sampled_from([op for op, _ in BAD_OPERATIONS])
_BAD_OPERATION_IDS = frozenset(id(op) for op, _ in BAD_OPERATIONS)


@settings(FUZZ_WITH_FIXTURES, max_examples=40)
@given(st.lists(st.one_of(good_ops, good_ops, bad_ops), max_size=6))
def test_a_fuzzed_batch_either_applies_completely_or_writes_nothing(
    storage: Storage, operations: list[Any]
) -> None:
    before = dict(storage.scan("fz/"))
    valid = all(id(op) not in _BAD_OPERATION_IDS for op in operations)
    if not valid:
        with pytest.raises((TypeError, ValueError)):
            storage.batch(operations)
        assert dict(storage.scan("fz/")) == before
        return
    storage.batch(operations)
    expected = dict(before)
    for op in operations:
        if isinstance(op, Put):
            expected[op.key] = op.value
        else:
            expected.pop(op.key, None)
    assert dict(storage.scan("fz/")) == expected


def test_workflow_records_refuse_values_messagepack_cannot_store() -> None:
    from weft_sync.codec import WorkflowRecord

    with pytest.raises(ValueError, match="MessagePack"):
        encode_workflow_record(WorkflowRecord("wf-1", "import", "running", input=object()))
    with pytest.raises(ValueError, match="status"):
        encode_workflow_record(WorkflowRecord("wf-1", "import", "paused"))
    with pytest.raises(ValueError, match="epoch"):
        encode_epoch(0)
    with pytest.raises(ValueError, match="expires_at"):
        encode_holder(HolderRecord("e", 1, -1, 0))
