"""Rotating scan windows: bounded reads that cover every key within a stated number of passes."""

from __future__ import annotations

import pytest

from weft_sync.maintenance.scan_windows import RotatingWindow
from weft_sync.storage import Put, Storage


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
