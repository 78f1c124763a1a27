"""The README's code example runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_python_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "the README has no python example"
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {}
    exec(compile(blocks[0], str(README), "exec"), namespace)
    assert (tmp_path / "jobs.db").exists()
