"""``weft_sync.flask``: config, lazy per-process open, factories, handlers, ``flask weft``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import traceback
from collections.abc import Iterator
from pathlib import Path

import pytest
from flask import Flask, current_app

from tests.examples.helpers import REPO_ROOT, abandon
from tests.forking import expected_fork_warning
from tests.workflows.helpers import holder_engine
from weft_sync import Ownership, OwnershipOptions, ReclaimedWorkflow
from weft_sync.errors import ClosedError
from weft_sync.flask import (
    EXTENSION_KEY,
    WeftSync,
    close_all,
    gunicorn_post_worker_init,
    gunicorn_worker_exit,
)
from weft_sync.storage import Storage
from weft_sync.workflows import Workflows

FAST = {"claim_ttl": "900ms", "claim_renew_interval": "300ms"}


def make_app(url: str | None = None, name: str = "weft_test_app", **config: object) -> Flask:
    app = Flask(name)
    if url is not None:
        app.config["WEFT_SYNC_URL"] = url
    app.config.update(config)
    return app


@pytest.fixture
def weft() -> Iterator[WeftSync]:
    extension = WeftSync()
    yield extension
    close_all()


def test_init_app_sets_defaults_and_opens_nothing(weft: WeftSync, tmp_path: Path) -> None:
    app = Flask("weft_defaults", instance_path=str(tmp_path / "instance"))
    threads_before = set(threading.enumerate())

    weft.init_app(app)

    assert app.config["WEFT_SYNC_URL"] == f"sqlite:///{tmp_path / 'instance' / 'weft_sync.db'}"
    assert app.config["WEFT_SYNC_OPTIONS"] == {}
    assert app.config["WEFT_SYNC_BACKGROUND"] == "thread"
    assert not (tmp_path / "instance").exists()
    assert set(threading.enumerate()) == threads_before
    assert app.extensions[EXTENSION_KEY].url == app.config["WEFT_SYNC_URL"]


def test_the_default_store_is_created_in_the_instance_folder_on_first_use(
    weft: WeftSync, tmp_path: Path
) -> None:
    app = Flask("weft_instance", instance_path=str(tmp_path / "instance"))
    weft.init_app(app)

    with app.app_context():
        weft.ownership.workflows.start("job-1", "report")

    assert (tmp_path / "instance" / "weft_sync.db").exists()


def test_ownership_opens_on_first_use_and_is_shared_by_requests(
    weft: WeftSync, storage_url: str, storage: Storage
) -> None:
    app = make_app(storage_url, WEFT_SYNC_OPTIONS=FAST)
    weft.init_app(app)
    seen: list[Ownership] = []

    @app.post("/start/<job_id>")
    def start(job_id: str) -> str:
        seen.append(weft.ownership)
        weft.ownership.workflows.start(job_id, "report")
        return weft.ownership.engine_id

    client = app.test_client()
    first = client.post("/start/a").get_data(as_text=True)
    second = client.post("/start/b").get_data(as_text=True)

    assert first == second
    assert seen[0] is seen[1]
    assert seen[0].started
    assert (seen[0].registry.claim_ttl_ms, seen[0].registry.claim_renew_interval_ms) == (900, 300)
    assert holder_engine(storage, "a") == holder_engine(storage, "b") == first


def test_concurrent_first_use_opens_exactly_one_ownership(weft: WeftSync, storage_url: str) -> None:
    app = make_app(storage_url, WEFT_SYNC_OPTIONS=FAST)
    weft.init_app(app)
    barrier = threading.Barrier(8)
    got: list[Ownership] = []
    errors: list[BaseException] = []

    def first_use() -> None:
        try:
            barrier.wait(5)
            got.append(weft.get_ownership(app))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=first_use, name=f"first-use-{i}") for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)

    assert errors == []
    assert len(got) == 8
    assert len({id(o) for o in got}) == 1


def test_options_may_be_an_ownership_options_and_background_manual(
    weft: WeftSync, storage_url: str
) -> None:
    options = OwnershipOptions(claim_ttl="3s", claim_renew_interval="1s")
    app = make_app(storage_url, WEFT_SYNC_OPTIONS=options, WEFT_SYNC_BACKGROUND="manual")
    weft.init_app(app)

    ownership = weft.get_ownership(app)

    assert ownership.registry.claim_ttl_ms == 3000
    assert not ownership.started
    assert ownership.run_maintenance().failed_count == 0


@pytest.mark.parametrize(
    ("config", "error", "fragment"),
    [
        ({"WEFT_SYNC_URL": 42}, TypeError, "WEFT_SYNC_URL must be a store URL string"),
        ({"WEFT_SYNC_URL": "redis://u:hunter2@h/0"}, ValueError, "has the scheme 'redis'"),
        ({"WEFT_SYNC_OPTIONS": "30s"}, TypeError, "WEFT_SYNC_OPTIONS must be an OwnershipOptions"),
        ({"WEFT_SYNC_OPTIONS": {"ttl": "3s"}}, TypeError, "'ttl'"),
        (
            {"WEFT_SYNC_OPTIONS": {"claim_ttl": "1s", "claim_renew_interval": "1s"}},
            ValueError,
            "strictly less than claim_ttl",
        ),
        ({"WEFT_SYNC_BACKGROUND": "asyncio"}, ValueError, "'asyncio'"),
    ],
)
def test_bad_config_is_refused_at_init_app_naming_the_value(
    weft: WeftSync, config: dict[str, object], error: type[Exception], fragment: str
) -> None:
    app = make_app(**config)

    with pytest.raises(error) as raised:
        weft.init_app(app)

    assert fragment in str(raised.value)
    assert "hunter2" not in str(raised.value)
    assert EXTENSION_KEY not in app.extensions


def test_an_app_factory_gives_each_app_its_own_store_and_ownership(
    weft: WeftSync, tmp_path: Path
) -> None:
    def create_app(name: str) -> Flask:
        app = make_app(f"sqlite:///{tmp_path / name}.db", name=name, WEFT_SYNC_OPTIONS=FAST)
        weft.init_app(app)
        return app

    first, second = create_app("first"), create_app("second")
    with first.app_context():
        weft.ownership.workflows.start("job-1", "report")
        first_engine = weft.ownership.engine_id
    with second.app_context():
        assert weft.ownership.workflows.get("job-1") is None
        assert weft.ownership.engine_id != first_engine

    weft.close(first)
    with pytest.raises(ClosedError, match="'first' was closed"):
        weft.get_ownership(first)
    assert not weft.get_ownership(second).closed


def test_init_app_twice_and_use_outside_an_app_context_are_errors(weft: WeftSync) -> None:
    app = make_app("sqlite:///unused.db")
    weft.init_app(app)

    with pytest.raises(RuntimeError, match="already has a WeftSync"):
        WeftSync(app)
    with pytest.raises(RuntimeError, match="needs an app context"):
        _ = weft.ownership
    with pytest.raises(RuntimeError, match="has no WeftSync"):
        weft.get_ownership(make_app("sqlite:///other.db", name="bare"))


def test_close_is_idempotent_and_releases_claims(
    weft: WeftSync, storage_url: str, storage: Storage
) -> None:
    app = make_app(storage_url, WEFT_SYNC_OPTIONS=FAST)
    weft.init_app(app)
    ownership = weft.get_ownership(app)
    ownership.workflows.start("job-1", "report")
    assert holder_engine(storage, "job-1") == ownership.engine_id

    gunicorn_worker_exit(object(), object())
    close_all()
    weft.close(app)

    assert ownership.closed
    assert holder_engine(storage, "job-1") is None
    assert Workflows(storage).get("job-1").status == "running"  # type: ignore[union-attr]


class _Worker:
    """What gunicorn_post_worker_init reads of a gunicorn worker: its loaded app."""

    def __init__(self, wsgi: object) -> None:
        self.wsgi = wsgi


def test_the_post_worker_init_hook_opens_the_workers_ownership_at_boot(
    weft: WeftSync, storage_url: str, storage: Storage
) -> None:
    app = make_app(storage_url, WEFT_SYNC_OPTIONS=FAST)
    weft.init_app(app)

    gunicorn_post_worker_init(_Worker(app))

    ownership = weft.get_ownership(app)
    assert not ownership.closed
    # The same one the first request gets: the hook opened it, the request reuses it.
    with app.test_request_context():
        assert weft.ownership is ownership
    ownership.workflows.start("job-1", "report")
    assert holder_engine(storage, "job-1") == ownership.engine_id


def test_the_post_worker_init_hook_refuses_a_worker_without_a_weft_app(weft: WeftSync) -> None:
    with pytest.raises(RuntimeError, match=r"worker.wsgi to be a Flask app .* got dict"):
        gunicorn_post_worker_init(_Worker({"not": "an app"}))
    with pytest.raises(RuntimeError, match=r"initialised by WeftSync, got Flask"):
        gunicorn_post_worker_init(_Worker(make_app("sqlite:///unused.db", name="no_weft")))


def test_a_store_that_cannot_open_at_boot_is_logged_and_tried_again_on_use(
    weft: WeftSync, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the store's directory should be")
    url = f"sqlite:///{blocker / 'store.db'}"
    app = make_app(url, name="weft_boot_failure")
    weft.init_app(app)

    with caplog.at_level("ERROR", logger="weft_sync.flask"):
        gunicorn_post_worker_init(_Worker(app))  # the worker still boots

    [record] = [r for r in caplog.records if r.name == "weft_sync.flask"]
    assert "could not open the ownership of app 'weft_boot_failure'" in record.getMessage()
    assert record.exc_info is not None
    blocker.unlink()
    blocker.mkdir()
    ownership = weft.get_ownership(app)  # the next use opens it
    assert not ownership.closed


def test_handlers_are_validated_when_registered(weft: WeftSync) -> None:
    def resume(ctx: object) -> None:
        pass

    weft.handler("report")(resume)
    weft.handler("report")(resume)  # the same function again is fine

    with pytest.raises(ValueError, match="already has the handler"):
        weft.handler("report")(lambda ctx: None)
    with pytest.raises(ValueError, match="non-empty string"):
        weft.handler("")
    with pytest.raises(TypeError, match="workflow type must be a str"):
        weft.handler(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must be callable"):
        weft.handler("other")("resume")  # type: ignore[type-var]
    with pytest.raises(TypeError, match="handlers must be a mapping"):
        WeftSync(handlers=[resume])  # type: ignore[arg-type]
    assert weft.handlers() == {"report": resume}
    assert WeftSync(handlers={"report": resume}).handlers() == {"report": resume}


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork()")
def test_a_forked_child_opens_its_own_ownership(
    weft: WeftSync, storage_url: str, storage: Storage, tmp_path: Path
) -> None:
    # Manual maintenance: no thread of the library is inside the store when the test forks.
    app = make_app(storage_url, WEFT_SYNC_OPTIONS=FAST, WEFT_SYNC_BACKGROUND="manual")
    weft.init_app(app)
    parent = weft.get_ownership(app)
    parent.workflows.start("parent-job", "report")
    report = tmp_path / "child.txt"

    with expected_fork_warning():
        pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 1
        try:
            child = weft.get_ownership(app)
            assert child is not parent and child.engine_id != parent.engine_id
            child.workflows.start("child-job", "report")
            child.close()
            report.write_text(child.engine_id)
            code = 0
        except BaseException:
            report.write_text(traceback.format_exc())
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)

    assert os.waitstatus_to_exitcode(status) == 0, report.read_text()
    assert holder_engine(storage, "parent-job") == parent.engine_id
    assert Workflows(storage).get("child-job").status == "running"  # type: ignore[union-attr]
    assert weft.get_ownership(app) is parent


def test_flask_weft_lists_every_weft_sync_subcommand(weft: WeftSync, tmp_path: Path) -> None:
    app = make_app(f"sqlite:///{tmp_path / 'cli.db'}")
    weft.init_app(app)

    result = app.test_cli_runner().invoke(args=["weft", "--help"])

    assert result.exit_code == 0
    for name in ("claims", "workflows", "show", "maintain", "metrics", "doctor", "cancel"):
        assert f"  {name} " in result.output
    # A subcommand's --help is weft-sync's own.
    shown = app.test_cli_runner().invoke(args=["weft", "show", "--help"])
    assert shown.exit_code == 0
    assert "usage: flask weft show" in shown.output and "workflow_id" in shown.output


def test_flask_weft_claims_and_show_read_the_apps_store(weft: WeftSync, storage_url: str) -> None:
    app = make_app(storage_url, WEFT_SYNC_OPTIONS=FAST)
    weft.init_app(app)
    ownership = weft.get_ownership(app)
    ownership.workflows.start("job-7", "report")
    runner = app.test_cli_runner()

    claims = runner.invoke(args=["weft", "claims", "--json"])
    shown = runner.invoke(args=["weft", "show", "job-7"])
    missing = runner.invoke(args=["weft", "show", "job-nope"])
    usage = runner.invoke(args=["weft", "claims", "--bogus"])

    assert claims.exit_code == 0, claims.output
    assert '"workflow_id": "job-7"' in claims.output
    assert ownership.engine_id in claims.output
    assert shown.exit_code == 0
    assert re.search(r"^status\s+running$", shown.output, re.M), shown.output
    assert missing.exit_code == 3
    assert usage.exit_code == 2


def test_importing_without_flask_names_the_extra_to_install() -> None:
    code = (
        "import sys\n"
        "sys.modules['flask'] = None\n"
        "try:\n"
        "    import weft_sync.flask\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
        "    raise SystemExit(0)\n"
        "raise SystemExit('imported without Flask')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )

    assert done.returncode == 0, done.stderr
    assert 'pip install "weft_sync[flask]"' in done.stdout
    # weft_sync itself never needs Flask.
    plain = subprocess.run(
        [sys.executable, "-c", "import sys; sys.modules['flask'] = None; import weft_sync"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert plain.returncode == 0, plain.stderr


def test_a_handler_resumes_a_reclaimed_workflow_inside_an_app_context(
    weft: WeftSync, storage_url: str, storage: Storage
) -> None:
    seen: list[tuple[str, str, int, bytes | None]] = []

    @weft.handler("report")
    def resume_report(ctx: ReclaimedWorkflow) -> None:
        checkpoint = ctx.workflows.load_checkpoint(ctx.workflow_id)
        seen.append((current_app.name, ctx.workflow_id, ctx.epoch, checkpoint))
        ctx.workflows.complete(ctx.workflow_id, result={"resumed_by": ctx.ownership.engine_id})

    abandon(storage_url, "report-1", "report", checkpoint=b"step 2")
    abandon(storage_url, "other-1", "other")
    app = make_app(storage_url, name="resumer", WEFT_SYNC_BACKGROUND="manual")
    weft.init_app(app)
    ownership = weft.get_ownership(app)

    ownership.run_maintenance()

    assert seen == [("resumer", "report-1", 2, b"step 2")]
    ledger = Workflows(storage)
    assert ledger.get("report-1").status == "completed"  # type: ignore[union-attr]
    assert ledger.get_outcome("report-1").result == {  # type: ignore[union-attr]
        "resumed_by": ownership.engine_id
    }
    # No handler for "other": this engine leaves it alone rather than strand it.
    assert holder_engine(storage, "other-1") == "dead-engine"


def test_a_handler_registered_after_open_is_used_by_the_open_ownership(
    weft: WeftSync, storage_url: str, storage: Storage
) -> None:
    app = make_app(storage_url, WEFT_SYNC_BACKGROUND="manual")
    weft.init_app(app)
    ownership = weft.get_ownership(app)
    abandon(storage_url, "late-1", "late")
    ownership.run_maintenance()
    assert holder_engine(storage, "late-1") == "dead-engine"

    @weft.handler("late")
    def resume_late(ctx: ReclaimedWorkflow) -> None:
        ctx.workflows.complete(ctx.workflow_id)

    weft.handler("late")(resume_late)  # the same handler again changes nothing
    ownership.run_maintenance()

    assert Workflows(storage).get("late-1").status == "completed"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "args",
    [["claims"], ["workflows", "--json"], ["show", "job-1"], ["metrics"], ["doctor"]],
    ids=lambda args: args[0],
)
def test_flask_weft_runs_each_read_command_on_the_apps_store(
    weft: WeftSync, storage_url: str, args: list[str]
) -> None:
    app = make_app(storage_url, WEFT_SYNC_OPTIONS=FAST)
    weft.init_app(app)
    weft.get_ownership(app).workflows.start("job-1", "report")

    result = app.test_cli_runner().invoke(args=["weft", *args])

    assert result.exit_code == 0, result.output
    assert result.output.strip()


def test_the_constructor_form_initialises_the_app(tmp_path: Path) -> None:
    app = make_app(f"sqlite:///{tmp_path / 'ctor.db'}", WEFT_SYNC_BACKGROUND="manual")
    weft = WeftSync(app)
    try:
        with app.app_context():
            assert weft.ownership is weft.get_ownership(app)
            assert weft.ownership.workflows.list() == []
    finally:
        weft.close(app)


def test_a_bad_url_is_reported_without_its_password() -> None:
    with pytest.raises(ValueError) as raised:
        WeftSync(make_app("mysql://root:s3cret@db/app"))

    assert "s3cret" not in str(raised.value)
    assert "mysql://root:***@db/app" in str(raised.value)


def test_the_readme_flask_example_builds_an_app_that_opens_nothing() -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "WeftSync" in b]
    # Not "__main__": the example's own main block sends a request, which opens the store.
    namespace: dict[str, object] = {"__name__": "readme_flask_example"}
    threads_before = set(threading.enumerate())

    exec(compile(block, "README.md", "exec"), namespace)
    app = namespace["create_app"]()  # type: ignore[operator]

    state = app.extensions[EXTENSION_KEY]
    assert state.url == "sqlite:///" + os.path.join(app.instance_path, "weft_sync.db")
    assert state.options == OwnershipOptions(claim_ttl="30s", claim_renew_interval="5s")
    assert list(namespace["weft"].handlers()) == ["report"]  # type: ignore[attr-defined]
    assert set(threading.enumerate()) == threads_before


def test_flask_weft_maintain_drives_what_it_takes_over_with_the_apps_handlers(
    weft: WeftSync, storage_url: str
) -> None:
    app = make_app(storage_url, WEFT_SYNC_OPTIONS=FAST)
    weft.init_app(app)
    driven: list[tuple[str, str, int]] = []

    @weft.handler("report")
    def resume_report(ctx: ReclaimedWorkflow) -> None:
        driven.append((current_app.name, ctx.workflow_id, ctx.epoch))
        ctx.workflows.complete(ctx.workflow_id, result={"resumed": True})

    abandon(storage_url, "report-1", "report")
    abandon(storage_url, "import-1", "import")  # no handler: left alone

    result = app.test_cli_runner().invoke(args=["weft", "maintain", "--once"])

    assert result.exit_code == 0, result.output
    # Run by the command's engine, at the epoch its takeover minted, inside an app context.
    assert driven == [("weft_test_app", "report-1", 2)]
    with app.app_context():
        ledger = weft.ownership.workflows
        assert ledger.get_outcome("report-1").result == {"resumed": True}  # type: ignore[union-attr]
        assert ledger.get("import-1").status == "running"  # type: ignore[union-attr]
