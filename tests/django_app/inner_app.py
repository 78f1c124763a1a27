"""``weft_sync.django`` inside a configured Django process (run by ``test_django_app.py``).

Django settings are process-global, so this module is not collected by the normal run: the
outer test runs it with pytest in a subprocess per database backend, with
``WEFT_TEST_DJANGO_DB`` naming a fresh SQLite file or PostgreSQL database.
"""

from __future__ import annotations

import io
import json
import os
import sqlite3
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.django_app.site_settings")
django.setup()

import pytest  # noqa: E402
from django.conf import settings  # noqa: E402
from django.contrib.auth.models import Permission, User  # noqa: E402
from django.core import checks  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.core.management.base import CommandError, SystemCheckError  # noqa: E402
from django.db import connection  # noqa: E402
from django.test import Client, override_settings  # noqa: E402

from tests.django_app import site_handlers  # noqa: E402
from tests.examples.helpers import abandon  # noqa: E402
from tests.forking import expected_fork_warning  # noqa: E402
from tests.workflows.helpers import stored_epoch  # noqa: E402
from weft_sync.django import close_ownership, get_ownership  # noqa: E402
from weft_sync.django.conf import load_config  # noqa: E402
from weft_sync.django.runtime import is_open  # noqa: E402
from weft_sync.redaction import redact_url  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _migrated() -> None:
    call_command("migrate", verbosity=0)


@pytest.fixture(autouse=True)
def _fresh_store() -> Iterator[None]:
    """Each test gets a weft table of its own in the database, and closes what it opened."""
    table = "weft_" + uuid.uuid4().hex[:12]
    config = {
        **settings.WEFT_SYNC,
        "STORAGE": {**settings.WEFT_SYNC.get("STORAGE", {}), "table": table},
    }
    site_handlers.HANDLED.clear()
    site_handlers.CONNECTIONS.clear()
    with override_settings(WEFT_SYNC=config):
        yield
    close_ownership()


@pytest.fixture
def url() -> str:
    return load_config().url


def weft_ids(messages: list[Any]) -> list[str]:
    return sorted(m.id for m in messages if m.id.startswith("weft_sync."))


def run(*args: str, stderr: io.StringIO | None = None) -> str:
    out = io.StringIO()
    call_command("weft_sync", *args, stdout=out, stderr=stderr or io.StringIO())
    return out.getvalue()


# -- settings and system checks ----------------------------------------------------------------


def test_valid_settings_pass_every_check() -> None:
    assert weft_ids(checks.run_checks()) == []
    call_command("check")


# Only the aliases the checks read are added; no connection to them is ever made.
@pytest.mark.filterwarnings("ignore:Overriding setting DATABASES:UserWarning")
@pytest.mark.parametrize(
    ("weft_sync", "check_id", "text"),
    [
        (None, "weft_sync.E001", "settings.WEFT_SYNC is not set"),
        ({"DATABASE": "default", "COLOUR": 1}, "weft_sync.E001", "unknown keys 'COLOUR'"),
        ({"DATABASE": "default", "BACKGROUND": "fork"}, "weft_sync.E001", "'fork'"),
        ({"DATABASE": "default", "MAX_CLAIMS": 0}, "weft_sync.E001", '["MAX_CLAIMS"] is 0'),
        ({}, "weft_sync.E002", "exactly one of URL and DATABASE, got neither"),
        ({"URL": "sqlite:///x.db", "DATABASE": "default"}, "weft_sync.E002", "got both"),
        ({"URL": "redis://u:hunter2@h/0"}, "weft_sync.E002", "unsupported scheme 'redis'"),
        ({"URL": "sqlite://"}, "weft_sync.E002", "names no SQLite file"),
        ({"DATABASE": "reports"}, "weft_sync.E003", "'reports', which is not in"),
        ({"DATABASE": "mysql"}, "weft_sync.E004", "'django.db.backends.mysql'"),
        ({"DATABASE": "memory"}, "weft_sync.E004", "in-memory"),
        (
            {"DATABASE": "default", "OPTIONS": {"claim_ttl": "2s", "claim_renew_interval": "1s"}},
            "weft_sync.E005",
            "at least 3000ms",
        ),
        ({"DATABASE": "default", "OPTIONS": {"ttl": "2s"}}, "weft_sync.E005", "'ttl'"),
        (
            {"DATABASE": "default", "HANDLERS": {"report": "tests.django_app.nope.run"}},
            "weft_sync.E006",
            "'tests.django_app.nope.run' does not import",
        ),
        ({"DATABASE": "default", "HANDLERS": ["report"]}, "weft_sync.E006", "must map"),
        (
            {
                "DATABASE": "default",
                "HANDLERS": {"report": "tests.django_app.site_handlers.NOT_CALLABLE"},
            },
            "weft_sync.E007",
            "is a int, not a callable",
        ),
    ],
)
def test_each_bad_setting_is_reported_under_its_check_id(
    weft_sync: Any, check_id: str, text: str
) -> None:
    databases = {
        **settings.DATABASES,
        "mysql": {"ENGINE": "django.db.backends.mysql", "NAME": "x"},
        "memory": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"},
    }
    with override_settings(WEFT_SYNC=weft_sync, DATABASES=databases):
        found = [m for m in checks.run_checks() if m.id.startswith("weft_sync.")]
        assert [m.id for m in found] == [check_id], [m.msg for m in found]
        assert text in found[0].msg
        assert "hunter2" not in found[0].msg
        with pytest.raises(SystemCheckError):
            call_command("check")


def test_a_bad_setting_keeps_get_ownership_from_opening() -> None:
    from django.core.exceptions import ImproperlyConfigured

    with (
        override_settings(WEFT_SYNC={"DATABASE": "nope"}),
        pytest.raises(ImproperlyConfigured, match=r"'nope', which is not in settings\.DATABASES"),
    ):
        get_ownership()


def test_the_url_of_a_database_alias_names_that_database_and_hides_its_password(
    url: str,
) -> None:
    db = connection.settings_dict
    if connection.vendor == "sqlite":
        assert url.split("?")[0] == "sqlite:///" + os.path.abspath(db["NAME"])
    else:
        assert url.startswith("postgresql://")
        assert f"/{db['NAME']}?" in url
        assert "max_size=4" in url
    assert "s3cr3t" not in redact_url("postgresql://app:s3cr3t@db/app?password=s3cr3t")
    assert redact_url("postgresql://app:s3cr3t@db/app") == "postgresql://app:***@db/app"


@pytest.mark.filterwarnings("ignore:Overriding setting DATABASES:UserWarning")
@pytest.mark.parametrize(
    ("host", "port", "expected_host"),
    [("db.example", "5433", "db.example"), ("/run/postgresql", "", "/run/postgresql")],
)
def test_a_postgresql_alias_becomes_a_libpq_url_with_its_password_masked_in_messages(
    host: str, port: str, expected_host: str
) -> None:
    from psycopg.conninfo import conninfo_to_dict

    alias = {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": "app db",
        "USER": "app",
        "PASSWORD": "p@ss:w/rd",
        "HOST": host,
        "PORT": port,
        "OPTIONS": {"sslmode": "prefer", "isolation_level": 1, "pool": True},
    }
    with override_settings(
        DATABASES={**settings.DATABASES, "pg": alias}, WEFT_SYNC={"DATABASE": "pg"}
    ):
        config = load_config()

    params = conninfo_to_dict(config.url)
    assert (params["dbname"], params["user"], params["password"]) == ("app db", "app", "p@ss:w/rd")
    assert (params["host"], params.get("port", "")) == (expected_host, port)
    assert params["sslmode"] == "prefer"
    assert "isolation_level" not in params and "pool" not in params
    assert "p@ss" not in redact_url(config.url) and "p@ss" not in repr(config)
    assert config.source == 'settings.DATABASES["pg"]'


# -- the per-process Ownership ---------------------------------------------------------------


def test_get_ownership_keeps_the_claims_in_the_django_database() -> None:
    ownership = get_ownership()
    ownership.workflows.start("report-1", "report", input={"pages": 1})

    table = settings.WEFT_SYNC["STORAGE"]["table"]
    assert table in connection.introspection.table_names()
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT count(*) FROM {table} WHERE key = %s", ["wf:report-1"])
        assert cursor.fetchone() == (1,)
    ownership.workflows.complete("report-1")


def test_get_ownership_opens_once_for_every_thread_of_the_process() -> None:
    barrier = threading.Barrier(8)
    seen: list[object] = []
    errors: list[BaseException] = []

    def use() -> None:
        try:
            barrier.wait()
            seen.append(get_ownership())
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=use) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert errors == []
    assert len(seen) == 8 and all(o is seen[0] for o in seen)
    assert get_ownership() is seen[0]


def test_an_engine_at_max_claims_takes_nothing_over(url: str) -> None:
    with override_settings(WEFT_SYNC={**settings.WEFT_SYNC, "MAX_CLAIMS": 1}):
        abandon(load_config().url, "report-9", "report")
        ownership = get_ownership()
        ownership.workflows.start("report-mine", "report")

        ownership.run_maintenance()

        assert site_handlers.HANDLED == []
        assert stored_epoch(ownership.storage, "report-9") == 1


def test_the_first_request_opens_the_ownership_when_asked_to() -> None:
    with override_settings(WEFT_SYNC={**settings.WEFT_SYNC, "OPEN_ON_REQUEST": False}):
        Client().get("/admin/login/")
        assert not is_open()
    with override_settings(WEFT_SYNC={**settings.WEFT_SYNC, "OPEN_ON_REQUEST": True}):
        Client().get("/admin/login/")
        assert is_open()


def test_close_ownership_releases_its_claims_and_the_next_use_opens_a_new_engine() -> None:
    first = get_ownership()
    first.workflows.start("report-2", "report")
    close_ownership()

    assert first.closed
    second = get_ownership()
    assert second is not first and second.engine_id != first.engine_id
    # Released by the close: the new engine can resume it at once.
    second.workflows.resume("report-2")
    # Closed directly rather than through close_ownership(): replaced just the same.
    second.close()
    assert get_ownership() is not second


def test_a_forked_child_opens_its_own_ownership_and_leaves_the_parents_alone() -> None:
    if connection.vendor != "sqlite":
        pytest.skip("fork with a live psycopg pool is the gunicorn test's business")
    parent = get_ownership()
    parent.workflows.start("report-3", "report")
    read, write = os.pipe()
    with expected_fork_warning():
        pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 1
        try:
            child = get_ownership()
            child.workflows.start("report-child", "report")
            os.write(write, child.engine_id.encode())
            child.workflows.complete("report-child")
            close_ownership()
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    child_engine = os.read(read, 200).decode()
    os.close(read)
    _, status = os.waitpid(pid, 0)

    assert os.waitstatus_to_exitcode(status) == 0
    assert child_engine and child_engine != parent.engine_id
    assert get_ownership() is parent
    assert parent.registry.current_epoch("report-3") == 1


# -- handlers --------------------------------------------------------------------------------


def test_a_reclaimed_workflow_is_driven_by_the_handler_of_its_type(url: str) -> None:
    abandon(url, "report-4", "report", input={"pages": 2}, checkpoint=b"1")
    abandon(url, "import-4", "import")
    ownership = get_ownership()

    ownership.run_maintenance()

    assert [h[:3] for h in site_handlers.HANDLED] == [("report-4", "report", 2)]
    outcome = ownership.workflows.get_outcome("report-4")
    assert outcome is not None
    assert (outcome.status, outcome.result) == ("completed", {"by": ownership.engine_id})
    assert ownership.workflows.load_checkpoint("report-4") == b"resumed"
    # No handler for "import": this engine does not take it over.
    assert ownership.workflows.get("import-4").status == "running"  # type: ignore[union-attr]
    assert stored_epoch(ownership.storage, "import-4") == 1
    # Like a request's, the handler's Django connection was closed when it returned.
    assert [_is_closed(raw) for raw in site_handlers.CONNECTIONS] == [True]


def _is_closed(raw: Any) -> bool:
    if connection.vendor != "sqlite":
        return bool(raw.closed)
    try:
        raw.execute("SELECT 1")
    except sqlite3.ProgrammingError:
        return True
    return False


# -- manage.py weft_sync ---------------------------------------------------------------------


def test_the_management_command_runs_cli_commands_on_the_configured_store() -> None:
    ownership = get_ownership()
    ownership.workflows.start("report-5", "report")

    claims = run("claims", "--json")
    rows = json.loads(claims)
    assert [(r["workflow_id"], r["engine_id"]) for r in rows] == [("report-5", ownership.engine_id)]
    assert "report-5" in run("workflows", "--status", "running")
    assert "report-5" in run("show", "report-5")
    run("cancel", "report-5")
    assert ownership.workflows.get("report-5").status == "cancelled"  # type: ignore[union-attr]


def test_the_management_command_turns_cli_errors_into_command_errors() -> None:
    stderr = io.StringIO()
    with pytest.raises(CommandError) as bad_url:
        run("--url", "mysql://app:hunter2@db/app", "claims", stderr=stderr)
    assert bad_url.value.returncode == 2
    assert str(bad_url.value) == "weft-sync claims failed with exit code 2"
    assert "unsupported storage URL" in stderr.getvalue()
    assert "hunter2" not in stderr.getvalue() + str(bad_url.value)

    get_ownership()  # creates the store, so that only the workflow is missing
    missing_stderr = io.StringIO()
    with pytest.raises(CommandError) as missing:
        run("show", "no-such-workflow", stderr=missing_stderr)
    assert missing.value.returncode == 3
    assert "no-such-workflow" in missing_stderr.getvalue()

    with pytest.raises(CommandError, match="name a weft-sync command"):
        run()

    with (
        override_settings(WEFT_SYNC={"URL": "nope"}),
        pytest.raises(CommandError, match=r"settings\.WEFT_SYNC"),
    ):
        run("claims")


def test_the_management_command_names_the_settings_and_its_own_command_in_messages(
    tmp_path: Path,
) -> None:
    missing = f"sqlite:///{tmp_path / 'missing.db'}"
    out, stderr = io.StringIO(), io.StringIO()
    with override_settings(WEFT_SYNC={"URL": missing}), pytest.raises(CommandError) as failed:
        call_command("weft_sync", "doctor", stdout=out, stderr=stderr)
    assert failed.value.returncode == 1
    report = out.getvalue()
    assert "from settings.WEFT_SYNC" in report
    assert "'manage.py weft_sync doctor --fix' creates it" in report
    assert "'weft-sync " not in report

    with override_settings(WEFT_SYNC={"URL": missing}), pytest.raises(CommandError):
        call_command("weft_sync", "claims", stdout=io.StringIO(), stderr=stderr)
    assert "from settings.WEFT_SYNC" in stderr.getvalue()


# -- the admin -------------------------------------------------------------------------------


@pytest.fixture
def admin_client() -> Client:
    user, _ = User.objects.get_or_create(
        username="root", defaults={"is_staff": True, "is_superuser": True}
    )
    client = Client()
    client.force_login(user)
    return client


def test_the_admin_lists_workflows_and_claims_read_only(admin_client: Client) -> None:
    ownership = get_ownership()
    ownership.workflows.start("report-6", "report")

    listing = admin_client.get("/admin/weft_sync/workflow/")
    assert listing.status_code == 200
    body = listing.content.decode()
    assert "report-6" in body and ownership.engine_id in body and "running" in body
    assert (
        "report-6" in admin_client.get("/admin/weft_sync/workflow/?status=running").content.decode()
    )
    assert (
        "report-6"
        not in admin_client.get("/admin/weft_sync/workflow/?status=completed").content.decode()
    )
    claims = admin_client.get("/admin/weft_sync/claim/").content.decode()
    assert "report-6" in claims and ownership.engine_id in claims
    assert admin_client.get("/admin/weft_sync/workflow/add/").status_code == 404
    assert "weft_sync/workflow/" in admin_client.get("/admin/").content.decode()


def test_the_admin_cancel_action_cancels_through_the_ledger(admin_client: Client) -> None:
    ownership = get_ownership()
    ownership.workflows.start("report-7", "report")

    done = admin_client.post(
        "/admin/weft_sync/workflow/", {"workflow_id": ["report-7"], "cancel": "1"}, follow=True
    )

    assert done.status_code == 200
    assert "Cancelled &#x27;report-7&#x27;" in done.content.decode()
    assert ownership.workflows.get("report-7").status == "cancelled"  # type: ignore[union-attr]
    assert stored_epoch(ownership.storage, "report-7") == 2


def test_cancelling_from_the_admin_needs_the_cancel_permission() -> None:
    ownership = get_ownership()
    ownership.workflows.start("report-8", "report")
    viewer, _ = User.objects.get_or_create(username="viewer", defaults={"is_staff": True})
    viewer.user_permissions.set([Permission.objects.get(codename="view_workflow")])
    client = Client()
    client.force_login(viewer)

    assert client.get("/admin/weft_sync/workflow/").status_code == 200
    refused = client.post("/admin/weft_sync/workflow/", {"workflow_id": ["report-8"]})

    assert refused.status_code == 403
    assert ownership.workflows.get("report-8").status == "running"  # type: ignore[union-attr]
    anonymous = Client().get("/admin/weft_sync/workflow/")
    assert anonymous.status_code == 302 and "/admin/login/" in anonymous["Location"]


def test_a_close_refused_inside_a_pass_leaves_the_ownership_to_the_next_close(url: str) -> None:
    from weft_sync import Ownership, OwnershipOptions
    from weft_sync.clock import ManualClock

    ownership = get_ownership()
    refused: list[BaseException] = []

    @ownership.on_lost
    def stop(workflow_id: str) -> None:
        try:
            close_ownership()  # from inside the pass that found the loss: refused
        except RuntimeError as exc:
            refused.append(exc)

    assert ownership.registry.acquire("leader").status == "acquired"
    thief = Ownership.open(
        url,
        engine_id="engine-thief",
        options=OwnershipOptions(**settings.WEFT_SYNC["OPTIONS"]),
        clock=ManualClock(10**13),  # far past the claim's expiry
        background="manual",
    )
    try:
        assert thief.registry.takeover("leader").status == "acquired"
        ownership.run_maintenance(wait_handlers=0)  # the renewal finds it lost
        assert len(refused) == 1
        assert not ownership.closed and is_open()
        assert get_ownership() is ownership
        close_ownership()
        assert ownership.closed and not is_open()
    finally:
        thief.close()
