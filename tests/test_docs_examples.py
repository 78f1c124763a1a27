"""Every code example in the README and the documentation runs as written, or says it cannot.

A ``python`` block runs as a script of its own, in a fresh directory, and must exit 0 with
nothing on stderr (``-W error``: a warning fails it too). A block that needs what a test cannot
give it (a Django project, a PostgreSQL URL) is marked with ``<!-- fragment: why -->`` on the
line before it, and is only compiled; one marked ``<!-- fence-example: NAME -->`` is run against
real databases by ``tests/fencing/test_readme_fencing.py``. Every ``weft-sync`` command line in
a ``sh`` block must be accepted by the program's own parser. Every relative link points at a
file that exists.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted(
    [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "docs" / "guides").glob("*.md")]
)
FENCE = re.compile(r"^```(\w+)[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
FRAGMENT = re.compile(r"<!-- fragment: [^>]*\S[^>]*-->\s*$")
FENCE_EXAMPLE = re.compile(r"<!-- fence-example: (\w+) -->\s*$")
FENCE_TESTS = ROOT / "tests" / "fencing" / "test_readme_fencing.py"


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    language: str
    code: str
    fragment: bool
    run_by: str | None = None  # the name another test runs this block by

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def _blocks() -> list[Block]:
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in FENCE.finditer(text):
            before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
            line = text.count("\n", 0, match.start()) + 1
            fragment = bool(FRAGMENT.search(before))
            elsewhere = FENCE_EXAMPLE.search(before)
            run_by = elsewhere.group(1) if elsewhere else None
            found.append(Block(page, line, match.group(1), match.group(2), fragment, run_by))
    return found


BLOCKS = _blocks()
PYTHON = [b for b in BLOCKS if b.language == "python" and not b.fragment and not b.run_by]
ELSEWHERE = [b for b in BLOCKS if b.run_by]
FRAGMENTS = [b for b in BLOCKS if b.language == "python" and b.fragment]
SHELL = [b for b in BLOCKS if b.language == "sh"]


def test_the_pages_have_examples_to_check() -> None:
    assert len(PAGES) >= 10, PAGES
    assert len(PYTHON) >= 12, [b.name for b in PYTHON]
    # Fragments are the exception: at least two examples run for each one that cannot.
    assert len(FRAGMENTS) * 2 <= len(PYTHON), [b.name for b in FRAGMENTS]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("block", PYTHON, ids=[b.name for b in PYTHON])
def test_a_python_example_runs_as_written(block: Block, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(block.code)

    done = subprocess.run(
        [sys.executable, "-W", "error", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env={**_env(), "PYTHONPATH": str(ROOT)},
        check=False,
    )

    assert done.returncode == 0, f"{block.name}\n{done.stdout}\n{done.stderr}"
    assert done.stderr == "", f"{block.name}\n{done.stderr}"


@pytest.mark.parametrize("block", ELSEWHERE, ids=[b.name for b in ELSEWHERE])
def test_an_example_run_by_another_test_is_the_one_it_runs(block: Block) -> None:
    assert f'example("{block.run_by}")' in FENCE_TESTS.read_text(), block.name
    compile(block.code, block.name, "exec")


@pytest.mark.parametrize("block", FRAGMENTS, ids=[b.name for b in FRAGMENTS])
def test_a_fragment_is_at_least_valid_python(block: Block) -> None:
    compile(block.code, block.name, "exec")


def _weft_sync_commands() -> list[tuple[str, list[str]]]:
    commands = []
    for block in SHELL:
        for line in block.code.splitlines():
            lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
            lexer.whitespace_split = True  # (comments start at "#", as in sh)
            words: list[str] = []
            for token in [*lexer, ";"]:
                if token in {"&&", "||", ";", "|", "&"}:
                    if words and words[0] == "weft-sync":
                        commands.append((block.name, words[1:]))
                    words = []
                else:
                    words.append(token)
    return commands


COMMANDS = _weft_sync_commands()


def test_the_shell_examples_use_the_command_line() -> None:
    assert len(COMMANDS) >= 3, COMMANDS


@pytest.mark.parametrize("where,argv", COMMANDS, ids=[" ".join(a) for _, a in COMMANDS])
def test_a_documented_weft_sync_command_line_is_accepted_by_its_parser(
    where: str, argv: list[str]
) -> None:
    parser = build_cli_parser()
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # --version and --help print
            parser.parse_args(argv)
    except SystemExit as exc:
        assert exc.code == 0, f"{where}: weft-sync {' '.join(argv)} is refused"
    except argparse.ArgumentError as exc:  # pragma: no cover - exit_on_error is on
        pytest.fail(f"{where}: {exc}")


def build_cli_parser() -> argparse.ArgumentParser:
    """The ``weft-sync`` program's own argument parser."""
    from weft_sync.cli.app import _build_parser

    return _build_parser()


LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_points_at_a_file(page: Path) -> None:
    targets = [t for t in LINK.findall(page.read_text()) if "://" not in t]
    missing = [t for t in targets if not (page.parent / t).exists()]
    assert missing == [], f"{page.relative_to(ROOT)} links to missing files: {missing}"


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("WEFT_SYNC_")}


AUTODOC = re.compile(r"^\.\. auto(?:class|function|data|module):: (weft_sync[\w.]*)", re.MULTILINE)


def test_the_api_reference_documents_public_names_only() -> None:
    import importlib

    targets = AUTODOC.findall((ROOT / "docs" / "reference" / "api.md").read_text())
    assert len(targets) >= 20, targets
    for target in targets:
        module_name, _, name = target.rpartition(".")
        if module_name == "weft_sync":  # a module of its own, or a top-level name
            module = importlib.import_module("weft_sync")
            assert name in module.__all__ or name in {"errors"}, target
            continue
        module = importlib.import_module(module_name)
        assert name in getattr(module, "__all__", ()), f"{target} is not in {module_name}.__all__"
