"""SQLAlchemy ORM writes inside Ownership.fenced: flushed in the fence, refused when deposed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import String, select, update
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from tests.fencing.hosts import PAST_EXPIRY_MS, HostEnv, make_env
from weft_sync.errors import EngineDeposedError, WorkflowClaimLostWarning


@pytest.fixture(params=("sqlite", "postgres"))
def orm_env(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[HostEnv]:
    backend = request.param
    base = request.getfixturevalue("postgres_base_url") if backend == "postgres" else None
    env = make_env(backend, "sqlalchemy-session", tmp_path, base)
    try:
        yield env
    finally:
        env.close()


def _report_model(table: str) -> Any:
    class Base(DeclarativeBase):
        pass

    class Report(Base):
        __tablename__ = table
        id: Mapped[str] = mapped_column(String, primary_key=True)
        v: Mapped[str] = mapped_column(String)

    return Report


def test_orm_changes_are_flushed_inside_the_fence(orm_env: HostEnv) -> None:
    report = _report_model(orm_env.table)
    own = orm_env.ownership()
    own.registry.acquire("wf-1")
    session: Session = orm_env.connect()
    with own.fenced("wf-1", session) as s:
        assert s is session
        s.add(report(id="r1", v="draft"))  # pending until the fence's commit flushes it
    with own.fenced("wf-1", session) as s:
        s.execute(update(report).where(report.id == "r1").values(v="final"))
    assert orm_env.rows() == {"r1": "final"}


def test_deposed_owners_orm_writes_are_refused(orm_env: HostEnv) -> None:
    report = _report_model(orm_env.table)
    old = orm_env.ownership()
    old.registry.acquire("wf-1")
    session: Session = orm_env.connect()
    with old.fenced("wf-1", session) as s:
        s.add(report(id="r1", v="v1"))
    new = orm_env.ownership()
    orm_env.clock.advance(PAST_EXPIRY_MS)
    assert new.registry.takeover("wf-1").status == "acquired"
    with (
        pytest.warns(WorkflowClaimLostWarning),
        pytest.raises(EngineDeposedError),
        old.fenced("wf-1", session),
    ):
        pytest.fail("a deposed owner's block ran")
    # Changes made in the session's own transaction before the block: the block is a savepoint
    # of that transaction, refused; the transaction stays the host's to roll back.
    obj = session.get(report, "r1")
    assert obj is not None
    obj.v = "stale"
    with (
        pytest.raises(EngineDeposedError),
        old.fenced("wf-1", session) as s,
    ):
        s.add(report(id="r2", v="stale"))
    assert session.in_transaction()
    session.rollback()
    assert orm_env.rows() == {"r1": "v1"}
    fresh: Session = orm_env.connect()
    with new.fenced("wf-1", fresh) as s:
        row = s.scalars(select(report).where(report.id == "r1")).one()
        row.v = "v2"
    assert orm_env.rows() == {"r1": "v2"}


def test_nested_session_block_is_a_savepoint(orm_env: HostEnv) -> None:
    report = _report_model(orm_env.table)
    own = orm_env.ownership()
    own.registry.acquire("wf-1")
    session: Session = orm_env.connect()
    with session.begin():
        session.add(report(id="outer", v="1"))
        with own.fenced("wf-1", session):
            session.add(report(id="inner", v="2"))
        with (
            pytest.raises(EngineDeposedError),
            own.fenced("not-held", session),
        ):
            pytest.fail("ran without a claim")
    assert orm_env.rows() == {"outer": "1", "inner": "2"}


@pytest.mark.postgres_only
def test_autocommit_engine_is_refused(postgres_base_url: str, tmp_path: Path) -> None:
    import sqlalchemy

    env = make_env("postgres", "sqlalchemy-connection", tmp_path, postgres_base_url)
    try:
        own = env.ownership()
        own.registry.acquire("wf-1")
        url = env.db_url.replace("postgresql://", "postgresql+psycopg://", 1)
        engine = sqlalchemy.create_engine(url, isolation_level="AUTOCOMMIT")
        try:
            for make in (engine.connect, lambda: Session(engine)):
                with make() as conn:  # type: ignore[attr-defined]
                    with pytest.raises(ValueError, match="AUTOCOMMIT"), own.fenced("wf-1", conn):
                        pytest.fail("fenced on an autocommit connection")
                    assert not conn.in_transaction()
        finally:
            engine.dispose()
        assert env.rows() == {}
    finally:
        env.close()
