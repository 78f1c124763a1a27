"""fenced_atomic: Django model writes inside the fence, on Django's SQLite and PostgreSQL backends.

Django is configured in this process (``settings.configure`` when nothing configured it yet); each
test adds a database alias of its own for the store's database and drops it afterwards, so the
module works whatever else in the run configured Django.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import django
import psycopg
import pytest
from django.conf import settings

if not settings.configured:
    settings.configure(
        DATABASES={},
        INSTALLED_APPS=[],
        USE_TZ=True,
        DEFAULT_AUTO_FIELD="django.db.models.AutoField",
    )
    django.setup()

from django.db import connections, models, transaction
from django.db.transaction import TransactionManagementError
from psycopg.conninfo import conninfo_to_dict

from tests.fencing.hosts import PAST_EXPIRY_MS, HostEnv, make_env
from weft_sync.django.fence import fenced_atomic
from weft_sync.errors import EngineDeposedError, StorageError, WorkflowClaimLostWarning

REPORT_TABLE = "fence_report_" + uuid.uuid4().hex[:10]


class Report(models.Model):
    id = models.CharField(primary_key=True, max_length=64)
    v = models.CharField(max_length=64)

    class Meta:
        app_label = "weft_fence_tests"
        db_table = REPORT_TABLE


@dataclass
class DjangoEnv:
    env: HostEnv
    alias: str

    def rows(self) -> dict[str, str]:
        return {r.id: r.v for r in Report.objects.using(self.alias).all()}


def _database(env: HostEnv, mode: str) -> dict[str, Any]:
    if env.backend == "sqlite":
        options = {"transaction_mode": "IMMEDIATE"} if mode == "immediate" else {}
        return {"ENGINE": "django.db.backends.sqlite3", "NAME": env.db_url, "OPTIONS": options}
    info = conninfo_to_dict(env.db_url)
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": info.get("dbname", "postgres"),
        "USER": info.get("user", ""),
        "PASSWORD": info.get("password", ""),
        "HOST": info.get("host", ""),
        "PORT": info.get("port", ""),
    }


@pytest.fixture(params=("sqlite", "sqlite-immediate", "postgres"))
def dj(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[DjangoEnv]:
    backend, _, mode = str(request.param).partition("-")
    base = request.getfixturevalue("postgres_base_url") if backend == "postgres" else None
    env = make_env(backend, "sqlite3" if backend == "sqlite" else "psycopg", tmp_path, base)
    alias = "fence_" + uuid.uuid4().hex[:8]
    default = dict(connections.settings["default"])
    configured = connections.configure_settings({"default": default, alias: _database(env, mode)})
    connections.settings[alias] = configured[alias]
    try:
        with connections[alias].schema_editor() as editor:
            editor.create_model(Report)
        yield DjangoEnv(env, alias)
        with connections[alias].schema_editor() as editor:
            editor.delete_model(Report)
    finally:
        connections[alias].close()
        del connections[alias]
        del connections.settings[alias]
        env.close()


def test_model_writes_of_the_owner_land(dj: DjangoEnv) -> None:
    own = dj.env.ownership()
    own.registry.acquire("wf-1")
    with fenced_atomic("wf-1", using=dj.alias, ownership=own):
        Report.objects.using(dj.alias).create(id="r1", v="draft")
    with fenced_atomic("wf-1", using=dj.alias, ownership=own):
        Report.objects.using(dj.alias).filter(id="r1").update(v="final")
    assert dj.rows() == {"r1": "final"}


def test_deposed_owners_update_is_refused(dj: DjangoEnv) -> None:
    old, new = dj.env.ownership(), dj.env.ownership()
    old.registry.acquire("wf-1")
    with fenced_atomic("wf-1", using=dj.alias, ownership=old):
        Report.objects.using(dj.alias).create(id="r1", v="v1")
    dj.env.clock.advance(PAST_EXPIRY_MS)
    assert new.registry.takeover("wf-1").status == "acquired"
    with (
        pytest.warns(WorkflowClaimLostWarning),
        pytest.raises(EngineDeposedError),
        fenced_atomic("wf-1", using=dj.alias, ownership=old),
    ):
        Report.objects.using(dj.alias).update(v="stale")
    assert dj.rows() == {"r1": "v1"}
    with fenced_atomic("wf-1", using=dj.alias, ownership=new):
        report = Report.objects.using(dj.alias).get(id="r1")
        report.v = "v2"
        report.save(using=dj.alias)
    assert dj.rows() == {"r1": "v2"}


def test_nested_in_atomic_is_a_savepoint_that_still_checks(dj: DjangoEnv) -> None:
    own = dj.env.ownership()
    own.registry.acquire("wf-1")
    with transaction.atomic(using=dj.alias):
        Report.objects.using(dj.alias).create(id="outer", v="1")
        with fenced_atomic("wf-1", using=dj.alias, ownership=own):
            Report.objects.using(dj.alias).create(id="inner", v="2")
        with (
            pytest.raises(EngineDeposedError),
            fenced_atomic("not-held", using=dj.alias, ownership=own),
        ):
            Report.objects.using(dj.alias).create(id="refused", v="3")
    assert dj.rows() == {"outer": "1", "inner": "2"}


@pytest.mark.parametrize("dj", ["postgres"], indirect=True)
def test_postgres_block_is_begin_the_read_the_host_statements_the_check_and_commit(
    dj: DjangoEnv, tmp_path: Path
) -> None:
    own = dj.env.ownership()
    own.registry.acquire("wf-1")
    with fenced_atomic("wf-1", using=dj.alias, ownership=own):  # proves the connection
        Report.objects.using(dj.alias).create(id="r1", v="1")
    raw = connections[dj.alias].connection
    trace = tmp_path / "trace.txt"
    with trace.open("w") as out:
        raw.pgconn.trace(out.fileno())
        raw.pgconn.set_trace_flags(psycopg.pq.Trace.SUPPRESS_TIMESTAMPS)
        try:
            with fenced_atomic("wf-1", using=dj.alias, ownership=own):
                Report.objects.using(dj.alias).filter(id="r1").update(v="2")
        finally:
            raw.pgconn.untrace()
    lines = trace.read_text().splitlines()
    sent = [line.split("\t", 3)[-1].strip() for line in lines if line.startswith("F\t")]
    assert sent[0].startswith('"BEGIN') and "FOR SHARE" in sent[1], sent
    assert "weft_sync.fenced" in sent[3], sent  # the end check, before atomic's COMMIT
    assert len(sent) == 5, sent  # BEGIN, the read, the UPDATE, the end check, COMMIT
    assert dj.rows() == {"r1": "2"}


def test_complete_inside_fenced_atomic_commits_with_the_model_row(dj: DjangoEnv) -> None:
    own = dj.env.ownership()
    own.workflows.start("wf-1", "report")
    with fenced_atomic("wf-1", using=dj.alias, ownership=own):
        Report.objects.using(dj.alias).create(id="r1", v="done")
        own.workflows.complete("wf-1", {"rows": 1})
        assert own.registry.current_epoch("wf-1") == 1  # released only at the commit
    assert dj.rows() == {"r1": "done"}
    assert own.workflows.get("wf-1").status == "completed"  # type: ignore[union-attr]
    assert own.registry.current_epoch("wf-1") is None

    own.workflows.start("wf-2", "report")
    with pytest.raises(RuntimeError), fenced_atomic("wf-2", using=dj.alias, ownership=own):
        Report.objects.using(dj.alias).create(id="r2", v="done")
        own.workflows.complete("wf-2")
        raise RuntimeError("killed before the commit")
    assert dj.rows() == {"r1": "done"}
    assert own.workflows.get("wf-2").status == "running"  # type: ignore[union-attr]
    assert own.registry.current_epoch("wf-2") == 1


def test_a_commit_inside_fenced_atomic_is_refused_by_django(dj: DjangoEnv) -> None:
    own = dj.env.ownership()
    own.registry.acquire("wf-1")
    with (
        pytest.raises(TransactionManagementError),
        fenced_atomic("wf-1", using=dj.alias, ownership=own),
    ):
        Report.objects.using(dj.alias).create(id="r1", v="fenced")
        connections[dj.alias].commit()
    assert dj.rows() == {}


def test_a_commit_statement_inside_fenced_atomic_then_a_takeover_is_refused_at_the_end(
    dj: DjangoEnv,
) -> None:
    """A ``COMMIT`` through a raw cursor ends ``atomic``'s transaction behind Django's back.
    On PostgreSQL the driver begins the next one, which the block's end check refuses to
    commit; on SQLite Django runs with the driver in autocommit mode, so the next write commits
    on its own as it runs (no fence can undo that), and the block still raises at its end."""
    own = dj.env.ownership()
    own.registry.acquire("wf-1")
    postgres = dj.env.backend == "postgres"
    expected = (StorageError, EngineDeposedError)
    warns = contextlib.nullcontext() if postgres else pytest.warns(WorkflowClaimLostWarning)
    with warns, pytest.raises(expected), fenced_atomic("wf-1", using=dj.alias, ownership=own):
        Report.objects.using(dj.alias).create(id="r1", v="before the takeover")
        with connections[dj.alias].cursor() as cursor:
            cursor.execute("COMMIT")
        dj.env.take_over("wf-1")
        Report.objects.using(dj.alias).create(id="r2", v="deposed")
    rows = dj.rows()
    assert rows.get("r1") == "before the takeover", rows
    assert ("r2" in rows) is not postgres, rows
