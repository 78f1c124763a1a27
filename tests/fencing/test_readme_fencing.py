"""The fencing guide's examples (docs/guides/fencing.md) run as written, against real databases."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from weft_sync import Ownership

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "guides" / "fencing.md"


def example(name: str) -> str:
    match = re.search(
        rf"<!-- fence-example: {name} -->\n```python\n(.*?)```", GUIDE.read_text(), re.S
    )
    assert match, f"the fencing guide has no {name!r} fencing example"
    return match.group(1)


@pytest.fixture
def pg_schema(postgres_base_url: str) -> Iterator[tuple[str, str]]:
    """A schema of the test's own holding ``reports``, and a URL whose search_path starts there."""
    schema = "fence_readme_" + uuid.uuid4().hex[:8]
    with psycopg.connect(postgres_base_url, autocommit=True) as admin:
        admin.execute(f"CREATE SCHEMA {schema}")
        admin.execute(f"CREATE TABLE {schema}.reports (id TEXT PRIMARY KEY, status TEXT)")
        admin.execute(
            f"INSERT INTO {schema}.reports VALUES ('report-7', 'new'), ('report-8', 'new')"
        )
    sep = "&" if "?" in postgres_base_url else "?"
    url = f"{postgres_base_url}{sep}options=-csearch_path%3D{schema},public"
    try:
        yield schema, url
    finally:
        with psycopg.connect(postgres_base_url, autocommit=True) as admin:
            admin.execute(f"DROP SCHEMA {schema} CASCADE")


def _statuses(base_url: str, schema: str) -> dict[str, str]:
    with psycopg.connect(base_url) as conn:
        rows = conn.execute(f"SELECT id, status FROM {schema}.reports").fetchall()
    return dict(rows)


def _store_url(base_url: str) -> str:
    sep = "&" if "?" in base_url else "?"
    return f"{base_url}{sep}table=t_{uuid.uuid4().hex[:16]}"


def test_psycopg_example(postgres_base_url: str, pg_schema: tuple[str, str]) -> None:
    schema, url = pg_schema
    with Ownership.open(_store_url(postgres_base_url), background="manual") as ownership:
        exec(example("psycopg"), {"ownership": ownership, "DATABASE_URL": url})
    assert _statuses(postgres_base_url, schema)["report-7"] == "sent"


def test_sqlalchemy_example(postgres_base_url: str, pg_schema: tuple[str, str]) -> None:
    schema, url = pg_schema

    class Base(DeclarativeBase):
        pass

    class Report(Base):
        __tablename__ = "reports"
        id: Mapped[str] = mapped_column(String, primary_key=True)
        status: Mapped[str] = mapped_column(String)

    namespace = {
        "ownership": None,
        "Report": Report,
        "SQLALCHEMY_URL": url.replace("postgresql://", "postgresql+psycopg://", 1),
    }
    with Ownership.open(_store_url(postgres_base_url), background="manual") as ownership:
        namespace["ownership"] = ownership
        exec(example("sqlalchemy"), namespace)
        namespace["engine"].dispose()  # type: ignore[attr-defined]
    assert _statuses(postgres_base_url, schema)["report-8"] == "sent"


_DJANGO_PRELUDE = """
import django
from django.conf import settings

settings.configure(
    DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": DB_PATH}},
    INSTALLED_APPS=[], USE_TZ=True, DEFAULT_AUTO_FIELD="django.db.models.AutoField",
)
django.setup()
from django.db import connection, models

class Report(models.Model):
    id = models.CharField(primary_key=True, max_length=32)
    status = models.CharField(max_length=32)

    class Meta:
        app_label = "readme"
        db_table = "reports"

with connection.schema_editor() as editor:
    editor.create_model(Report)
Report.objects.create(id="report-9", status="new")

from weft_sync import Ownership
ownership = Ownership.open("sqlite:///" + DB_PATH, background="manual")
assert ownership.registry.acquire("report-9").status == "acquired"
"""

_DJANGO_CHECK = """
send_report("report-9")
assert Report.objects.get(id="report-9").status == "sent"
ownership.close()
print("sent")
"""


def test_django_example(tmp_path: Path) -> None:
    # Django's settings are process-wide: the example gets an interpreter of its own.
    script = "\n".join(
        [
            f"DB_PATH = {str(tmp_path / 'site.db')!r}",
            _DJANGO_PRELUDE,
            example("django"),
            _DJANGO_CHECK,
        ]
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "sent"
