"""Helpers the whole test suite shares, one concept per module (no tests, no fixtures).

- :mod:`tests.support.waiting`: polling waits with a hang guard (a condition that never comes
  fails the test and names what it waited for).
- :mod:`tests.support.sqlite_lock`: a script that holds a SQLite database's write lock from a
  process of its own.
- :mod:`tests.support.postgres_activity`: whether a PostgreSQL session sits inside a
  transaction (a paused process may hold row locks).
- :mod:`tests.support.clocks`: a clock wrapper that raises while a test says so (a host clock
  that fails).

Fixtures stay in the ``conftest.py`` files; helpers that only one folder's tests use stay in
that folder.
"""
