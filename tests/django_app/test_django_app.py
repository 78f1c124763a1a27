"""``weft_sync.django`` on Django's SQLite and PostgreSQL backends, one process per backend.

Django settings are process-global: each backend runs ``inner_app.py`` under pytest in a
subprocess whose settings (``site_settings.py``) point at a fresh SQLite file or a fresh
PostgreSQL database made here and dropped afterwards.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.django_app.databases import FreshPostgresDatabase
from tests.examples.helpers import REPO_ROOT, script_env

INNER = Path(__file__).with_name("inner_app.py")


@pytest.fixture
def django_database(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A SQLite path, or the URL of a PostgreSQL database of this test's own."""
    if backend == "sqlite":
        yield str(tmp_path / "site.sqlite3")
        return
    base: str = request.getfixturevalue("postgres_base_url")
    with FreshPostgresDatabase(base) as url:
        yield url


def test_the_django_app_on_the_backend(django_database: str) -> None:
    env = script_env()
    env["WEFT_TEST_DJANGO_DB"] = django_database
    env.pop("WEFT_SYNC_TEST_POSTGRES_DSN", None)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            str(INNER),
            "-q",
            "-x",
            "-n",
            "0",  # a few tests: one process (the repository's setup.cfg asks for two workers)
            "-p",
            "no:randomly",
            "-p",
            "no:cacheprovider",
        ],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert " passed" in done.stdout


def test_without_django_the_import_error_names_the_extra_to_install() -> None:
    blocked = "import sys; sys.modules['django'] = None; import weft_sync.django"
    done = subprocess.run(
        [sys.executable, "-c", blocked],
        cwd=REPO_ROOT,
        env=script_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1
    assert 'ImportError: weft_sync.django needs Django: pip install "weft_sync[django]"' in (
        done.stderr
    )


def test_importing_weft_sync_does_not_import_django() -> None:
    probe = "import sys, weft_sync; print('django' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=REPO_ROOT,
        env=script_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert done.stdout.strip() == "False"
