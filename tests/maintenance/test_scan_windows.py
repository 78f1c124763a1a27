"""Rotating scan windows: bounded reads that cover every key within a stated number of passes."""

from __future__ import annotations

from typing import Any

import pytest

from weft_sync.errors import StorageError
from weft_sync.reclaim.scan_windows import RotatingWindow, read_windows
from weft_sync.storage import Put, Storage
from weft_sync.storage.reads import ScanRange


def _fill(storage: Storage, prefix: str, count: int) -> list[str]:
    keys = [f"{prefix}{n:04d}" for n in range(count)]
    storage.batch([Put(k, b"v") for k in keys])
    return keys


@pytest.mark.parametrize("count", [0, 1, 9, 10, 11, 35])
def test_every_key_is_read_within_the_stated_passes(storage: Storage, count: int) -> None:
    keys = _fill(storage, "p:", count)
    storage.put("q:outside", b"x")
    window = RotatingWindow("p:", 10)
    seen: set[str] = set()
    for _ in range(window.passes_to_cover(count)):
        rows = window.read(storage)
        assert len(rows) <= 10
        assert all(key.startswith("p:") for key, _ in rows)
        seen.update(key for key, _ in rows)
    assert seen == set(keys)


def test_a_short_window_restarts_from_the_beginning(storage: Storage) -> None:
    _fill(storage, "p:", 15)
    window = RotatingWindow("p:", 10)
    first = [k for k, _ in window.read(storage)]
    second = [k for k, _ in window.read(storage)]
    third = [k for k, _ in window.read(storage)]
    assert first == [f"p:{n:04d}" for n in range(10)]
    assert second == [f"p:{n:04d}" for n in range(10, 15)]
    assert third == first


def test_keys_added_behind_the_cursor_are_read_after_the_wrap(storage: Storage) -> None:
    _fill(storage, "p:", 20)
    window = RotatingWindow("p:", 10)
    window.read(storage)
    storage.put("p:0000a", b"late")
    seen = {k for _ in range(window.passes_to_cover(21)) for k, _ in window.read(storage)}
    assert "p:0000a" in seen


@pytest.mark.parametrize("limit", [0, -1, 1.5, True, "10"])
def test_a_bad_limit_is_refused_naming_it(limit: object) -> None:
    with pytest.raises(ValueError, match="limit"):
        RotatingWindow("p:", limit)  # type: ignore[arg-type]


class FailingScans:
    """A real store whose scans fail while ``failing`` is set."""

    def __init__(self, inner: Storage) -> None:
        self.inner = inner
        self.failing = False

    def scan(self, prefix: str = "", **bounds: Any) -> list[tuple[str, bytes]]:
        if self.failing:
            raise StorageError("injected scan failure")
        return self.inner.scan(prefix, **bounds)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_windows_read_together_each_cover_their_prefix_within_the_stated_passes(
    storage: Storage,
) -> None:
    counts = {"p:": 23, "q:": 7, "r:": 0}
    wanted = {prefix: set(_fill(storage, prefix, count)) for prefix, count in counts.items()}
    storage.put("s:engine", b"e")
    windows = [RotatingWindow(prefix, 5) for prefix in counts]
    seen: dict[str, set[str]] = {prefix: set() for prefix in counts}
    for _ in range(windows[0].passes_to_cover(max(counts.values()))):
        *rows, extra = read_windows(storage, windows, also=[ScanRange("s:")])
        assert extra == [("s:engine", b"e")]
        for window, read in zip(windows, rows, strict=True):
            assert len(read) <= 5
            assert all(key.startswith(window.prefix) for key, _ in read)
            seen[window.prefix].update(key for key, _ in read)
    assert seen == wanted


def test_a_failed_read_moves_no_window(storage: Storage) -> None:
    _fill(storage, "p:", 12)
    _fill(storage, "q:", 12)
    failing = FailingScans(storage)
    windows = [RotatingWindow("p:", 5), RotatingWindow("q:", 5)]
    read_windows(failing, windows)  # type: ignore[arg-type]
    failing.failing = True
    with pytest.raises(StorageError, match="injected"):
        read_windows(failing, windows)  # type: ignore[arg-type]
    failing.failing = False
    rows = read_windows(failing, windows)  # type: ignore[arg-type]
    assert [[key for key, _ in read] for read in rows] == [
        [f"p:{n:04d}" for n in range(5, 10)],
        [f"q:{n:04d}" for n in range(5, 10)],
    ]
