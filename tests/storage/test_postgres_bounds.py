"""PostgreSQL waits are bounded: session timeouts derived from the renew interval, URL overrides
that reach the server intact, and bad values refused by name."""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Iterator

import psycopg
import pytest

from weft_sync.errors import StorageError
from weft_sync.storage import open_storage
from weft_sync.storage.postgres.store import PostgresStorage
from weft_sync.storage.session_locks import storage_session_locks

STORE_LOGGER = "weft_sync.storage.postgres.store"


def _with_params(url: str, query: str) -> str:
    return f"{url}{'&' if '?' in url else '?'}{query}"


@pytest.fixture
def table(postgres_base_url: str) -> Iterator[str]:
    name = "t_" + uuid.uuid4().hex[:16]
    yield name
    with psycopg.connect(postgres_base_url, autocommit=True) as conn:
        conn.execute(f'DROP TABLE IF EXISTS "{name}"')


def _show(store: PostgresStorage, setting: str) -> str:
    with store._connection("show") as conn:
        row = conn.execute(f"SHOW {setting}").fetchone()
    assert row is not None
    return str(row[0])


def test_sessions_run_with_timeouts_derived_from_the_renew_interval(
    postgres_base_url: str, table: str
) -> None:
    with PostgresStorage(postgres_base_url, table=table, renew_interval_ms=1200) as store:
        assert _show(store, "statement_timeout") == "1200ms"
        assert _show(store, "lock_timeout") == "600ms"
        assert store.wait_bounds.pool_timeout_s == pytest.approx(1.2)


def test_open_storage_derives_the_bounds_from_the_renew_interval_it_is_given(
    postgres_base_url: str, table: str
) -> None:
    url = _with_params(postgres_base_url, f"table={table}")
    with open_storage(url, renew_interval_ms=3000) as store:
        assert isinstance(store, PostgresStorage)
        assert _show(store, "statement_timeout") == "3s"
        # Half the interval, but never more than a second.
        assert _show(store, "lock_timeout") == "1s"
        assert store.wait_bounds.pool_timeout_s == pytest.approx(3.0)


def test_options_in_the_url_reach_the_server_with_their_spaces(
    postgres_base_url: str, table: str
) -> None:
    url = _with_params(postgres_base_url, f"table={table}&options=-c%20statement_timeout%3D7000")
    with open_storage(url, renew_interval_ms=1000) as store:
        assert isinstance(store, PostgresStorage)
        # The caller's own setting wins; the one it did not make is still derived.
        assert _show(store, "statement_timeout") == "7s"
        assert _show(store, "lock_timeout") == "500ms"


def test_url_parameters_override_the_derived_bounds(postgres_base_url: str, table: str) -> None:
    url = _with_params(
        postgres_base_url,
        f"table={table}&statement_timeout=3&lock_timeout=250ms&timeout=1.5&application_name=a%20b",
    )
    with open_storage(url, renew_interval_ms=1000) as store:
        assert isinstance(store, PostgresStorage)
        assert _show(store, "statement_timeout") == "3s"
        assert _show(store, "lock_timeout") == "250ms"
        # The URL's own name, then the store's tag.
        assert re.fullmatch(r"a b [0-9a-f]{16}", _show(store, "application_name"))
        assert store.wait_bounds.pool_timeout_s == pytest.approx(1.5)


@pytest.mark.parametrize(
    ("name", "raw"),
    [
        ("timeout", "inf"),
        ("timeout", "nan"),
        ("timeout", "-1"),
        ("timeout", "soon"),
        ("statement_timeout", "-5"),
        ("statement_timeout", "inf"),
        ("lock_timeout", "nan"),
        ("lock_timeout", "-2"),
        ("lock_timeout", "soon"),
        ("connect_timeout", "inf"),
        ("connect_timeout", "-1"),
        ("renew_interval_ms", "0"),
        ("renew_interval_ms", "fast"),
        ("pooler", "bogus"),
    ],
)
def test_senseless_url_values_are_a_value_error_naming_the_parameter(name: str, raw: str) -> None:
    with pytest.raises(ValueError, match=name):
        open_storage(f"postgresql://127.0.0.1:1/db?{name}={raw}")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"timeout": float("inf")},
        {"timeout": float("nan")},
        {"timeout": 0},
        {"statement_timeout": -1},
        {"statement_timeout": float("inf")},
        {"lock_timeout": float("nan")},
        {"renew_interval_ms": -100},
    ],
)
def test_senseless_keyword_values_are_a_value_error_naming_the_parameter(
    kwargs: dict[str, object],
) -> None:
    (name,) = kwargs
    with pytest.raises(ValueError, match=name):
        PostgresStorage("postgresql://127.0.0.1:1/db", **kwargs)  # type: ignore[arg-type]


def test_a_table_lock_held_elsewhere_fails_a_write_within_the_lock_timeout(
    postgres_base_url: str, table: str
) -> None:
    with PostgresStorage(postgres_base_url, table=table, renew_interval_ms=400) as store:
        store.put("k", b"v0")
        with psycopg.connect(postgres_base_url) as foreign:
            foreign.execute(f'LOCK TABLE "{table}" IN ACCESS EXCLUSIVE MODE')
            with pytest.raises(StorageError, match="lock timeout"):
                store.put("k", b"v1")
            foreign.rollback()
        store.put("k", b"v2")
        assert store.get("k") == b"v2"


def test_a_read_cut_by_a_server_bound_is_not_tried_again(
    postgres_base_url: str, table: str, caplog: pytest.LogCaptureFixture
) -> None:
    with PostgresStorage(postgres_base_url, table=table, lock_timeout=0.2) as store:
        store.put("k", b"v0")
        with psycopg.connect(postgres_base_url) as foreign:
            foreign.execute(f'LOCK TABLE "{table}" IN ACCESS EXCLUSIVE MODE')
            with (
                caplog.at_level(logging.DEBUG, logger=STORE_LOGGER),
                pytest.raises(StorageError, match="lock timeout"),
            ):
                store.get("k")
            foreign.rollback()
        assert "retrying" not in caplog.text  # a second wait would double the bound
        assert store.get("k") == b"v0"


def test_replication_settings_report_the_servers_commit_durability(
    postgres_base_url: str, table: str
) -> None:
    with PostgresStorage(postgres_base_url, table=table) as store:
        settings = store.replication_settings()
    with psycopg.connect(postgres_base_url, autocommit=True) as conn:
        commit = conn.execute("SHOW synchronous_commit").fetchone()
        standbys = conn.execute("SHOW synchronous_standby_names").fetchone()
    assert commit is not None and standbys is not None
    assert settings.synchronous_commit == commit[0]
    assert settings.synchronous_standby_names == standbys[0]
    assert settings.is_standby is False
    # A single server without synchronous standbys can lose acknowledged commits on failover.
    assert settings.failover_safe is bool(standbys[0].strip())


# -- settings weft relies on, read back -----------------------------------------------------


def test_the_session_keeps_idle_sessions_and_reads_back_every_bound_it_set() -> None:
    from weft_sync.storage.postgres.settings import (
        derive_wait_bounds,
        expected_settings,
        merged_options,
    )

    bounds = derive_wait_bounds(
        renew_interval_ms=2_000, statement_timeout_ms=None, lock_timeout_ms=None, timeout=None
    )
    kwargs = merged_options({}, bounds, idle_session=True)
    assert "-c idle_session_timeout=0" in kwargs["options"]
    assert "-c idle_in_transaction_session_timeout=4000" in kwargs["options"]
    assert (kwargs["keepalives"], kwargs["tcp_user_timeout"]) == (1, 2_000)
    # What the DSN sets is the caller's: neither sent again nor checked.
    own = {"options": "-c statement_timeout=7s", "keepalives_idle": "30"}
    assert "statement_timeout" not in expected_settings(own, bounds, idle_session=False)
    assert "keepalives_idle" not in merged_options(own, bounds)
    assert expected_settings({}, bounds, idle_session=True) == {
        "statement_timeout": 2_000,
        "lock_timeout": 1_000,
        "idle_in_transaction_session_timeout": 4_000,
        "idle_session_timeout": 0,
    }


def test_a_bound_not_in_effect_is_an_error_naming_it() -> None:
    from weft_sync.storage.postgres.settings import check_session_settings

    wanted = {"statement_timeout": 5_000, "idle_session_timeout": 0}
    check_session_settings({"statement_timeout": "5000", "idle_session_timeout": "0"}, wanted, "s")
    with pytest.raises(ValueError, match="statement_timeout is 0 ms, not 5000 ms") as raised:
        check_session_settings({"statement_timeout": "0"}, wanted, "pooled session")
    assert "idle_session_timeout is not reported by the server" in str(raised.value)
    assert "pooled session" in str(raised.value)


@pytest.mark.postgres_only
def test_a_real_session_runs_with_every_bound_read_back(postgres_base_url: str, table: str) -> None:
    with PostgresStorage(postgres_base_url, table=table, renew_interval_ms=2_000) as store:
        assert _show(store, "idle_session_timeout") == "0"
        assert _show(store, "idle_in_transaction_session_timeout") == "4s"
        assert _show(store, "statement_timeout") == "2s"


# -- poolers: a direct connection is never taken for one -----------------------------------------


@pytest.mark.postgres_only
def test_a_direct_connection_is_not_taken_for_a_pooler(
    postgres_base_url: str, table: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger=STORE_LOGGER):
        store = PostgresStorage(postgres_base_url, table=table, renew_interval_ms=2_000)
    with store:
        assert [r for r in caplog.records if r.name == STORE_LOGGER] == []
        assert store.capabilities.session_locks is True
        assert storage_session_locks(store) is not None
        assert _show(store, "statement_timeout") == "2s"  # the session's, sent at connect


@pytest.mark.postgres_only
def test_declared_pooling_on_a_direct_connection_bounds_each_transaction_and_leaves_the_session(
    postgres_base_url: str, table: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger=STORE_LOGGER):
        store = PostgresStorage(
            postgres_base_url, table=table, renew_interval_ms=2_000, pooler="transaction"
        )
    with store:
        assert "as declared (pooler=transaction)" in caplog.text
        with store._write_transaction("show") as conn:
            assert conn.execute("SHOW statement_timeout").fetchone() == ("2s",)
            assert conn.execute("SHOW lock_timeout").fetchone() == ("1s",)
        assert store._read("show", "SHOW idle_in_transaction_session_timeout", []) == [("4s",)]
        # No startup options, and SET LOCAL ends with its transaction: the session keeps the
        # server's defaults.
        assert _show(store, "statement_timeout") == "0"
        assert _show(store, "lock_timeout") == "0"
