"""What the docs say of the command line holds: its version, the demo's crash detection and its
refusal of ``--url``, handler imports from the working directory as ``python -m`` does, and
messages that name where a URL came from and the command the operator actually runs."""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import weft_sync
from tests.cli.helpers import abandon, assert_one_line_no_traceback, cli_env, run_cli_process
from weft_sync import Ownership
from weft_sync.cli.app import main


def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"weft-sync {weft_sync.__version__}\n"
    assert weft_sync.__version__ == "0.3.0.dev0"


@pytest.mark.slow
def test_the_demo_moves_a_killed_workers_claims_before_they_expire() -> None:
    done = run_cli_process("demo", "--workers", "2", "--workflows", "4", timeout=90)

    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    moved = [line for line in lines if "epoch 1 -> 2" in line]
    assert len(moved) == 2, done.stdout
    # A claim taken before the dead holder's expiry can only have moved by crash detection.
    assert all(line.endswith("before its claim expired") for line in moved), done.stdout
    assert "the crash was detected, not waited out" in done.stdout
    assert "refused by the store" in done.stdout
    assert done.stderr == ""


@pytest.mark.parametrize("where", ["before", "after"])
def test_the_demo_refuses_a_url_instead_of_ignoring_it(
    tmp_path: Path, where: str, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'mine.db'}"
    argv = ["--url", url, "demo"] if where == "before" else ["demo", "--url", url]

    assert main(argv, out=io.StringIO()) == 2

    assert_one_line_no_traceback(capsys.readouterr().err, "demo does not take --url", "--keep")
    assert list(tmp_path.iterdir()) == []


HANDLER_MODULE = textwrap.dedent(
    """
    def resume(ctx):
        ctx.workflows.save_checkpoint(ctx.workflow_id, b"from the working directory")
        print(f"resumed {ctx.workflow_id} from cwd", flush=True)
    """
)

# What pip writes as the ``weft-sync`` console script: sys.path[0] is the script's directory.
CONSOLE_SCRIPT = "import sys\nfrom weft_sync.cli.app import main\nsys.exit(main())\n"


def test_the_console_script_imports_a_handler_from_the_working_directory(
    tmp_path: Path,
) -> None:
    project, bin_dir = tmp_path / "project", tmp_path / "bin"
    (project / "myjobs").mkdir(parents=True)
    bin_dir.mkdir()
    (project / "myjobs" / "__init__.py").write_text("")
    (project / "myjobs" / "handlers.py").write_text(HANDLER_MODULE)
    (bin_dir / "weft-sync").write_text(CONSOLE_SCRIPT)
    url = f"sqlite:///{project / 'jobs.db'}"
    abandon(url, "wf-1")

    done = subprocess.run(
        [
            sys.executable,
            str(bin_dir / "weft-sync"),
            "--url",
            url,
            "maintain",
            "--once",
            "--handler",
            "myjobs.handlers:resume",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=project,
        env=cli_env(),
        check=False,
    )

    assert (done.returncode, done.stderr) == (0, ""), done.stdout + done.stderr
    assert "resumed wf-1 from cwd" in done.stdout
    with Ownership.open(url, background="manual") as ownership:
        assert ownership.workflows.load_checkpoint("wf-1") == b"from the working directory"


def test_a_bad_configured_url_is_reported_with_where_it_was_configured(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WEFT_SYNC_URL", "sqlite:///elsewhere.db")

    code = main(
        ["claims"],
        out=io.StringIO(),
        configured_url=("bogus://db", "settings.WEFT_SYNC"),
        prog="manage.py weft_sync",
    )

    assert code == 2
    assert_one_line_no_traceback(capsys.readouterr().err, "from settings.WEFT_SYNC", "bogus")


def test_an_explicit_url_wins_over_the_configured_one_and_is_named_as_such(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(
        ["claims", "--url", "bogus://cli"],
        out=io.StringIO(),
        configured_url=("sqlite:///fine.db", "settings.WEFT_SYNC"),
    )

    assert code == 2
    assert_one_line_no_traceback(capsys.readouterr().err, "from --url", "bogus")


def test_doctor_suggests_the_command_the_operator_runs(tmp_path: Path) -> None:
    out = io.StringIO()
    url = f"sqlite:///{tmp_path / 'missing.db'}"

    code = main(
        ["doctor"],
        out=out,
        configured_url=(url, "settings.WEFT_SYNC"),
        prog="manage.py weft_sync",
    )

    assert code == 1
    assert "'manage.py weft_sync doctor --fix' creates it" in out.getvalue()
    assert "from settings.WEFT_SYNC" in out.getvalue()
    assert "'weft-sync" not in out.getvalue()
