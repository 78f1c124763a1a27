"""Every mutant of ``tests/mutants/run.py`` still finds its site, and names tests that exist.

The mutant run takes minutes and is not part of the suite, so a refactor that moves a mutant's
line would otherwise leave that mutant reporting "site not found" unnoticed, and the check it
stands for silently gone. A pending mutant (of a fix another branch brings) may miss its site.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load_runner() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_mutant_runner", ROOT / "tests/mutants/run.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up while building the class
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


_MUTANTS = _load_runner().MUTANTS


def test_there_are_mutants() -> None:
    assert len(_MUTANTS) >= 30


@pytest.mark.parametrize("mutant", _MUTANTS, ids=lambda mutant: mutant.name)
def test_each_mutant_finds_its_site_exactly_once(mutant: Any) -> None:
    path = ROOT / mutant.path
    found = path.read_text().count(mutant.find)
    if mutant.pending is not None and found == 0:
        pytest.skip(f"pending: {mutant.pending}")
    assert found == 1, f"{mutant.name!r}: its site occurs {found} times in {mutant.path}"
    assert mutant.find != mutant.replace


@pytest.mark.parametrize("mutant", _MUTANTS, ids=lambda mutant: mutant.name)
def test_each_mutant_names_test_files_that_exist(mutant: Any) -> None:
    for test in mutant.tests:
        file = test.split("::", 1)[0]
        assert (ROOT / file).is_file(), f"{mutant.name!r} names {file}, which does not exist"
