"""The fence for Django: ``fenced_atomic(workflow_id, using)`` around ``transaction.atomic``.

``transaction.atomic(using=…)`` begins the transaction (or, nested, a savepoint) and ends it, so
model ``save()``, ``update()`` and raw cursors on that alias run inside the fence; the fence runs
its check first, on the alias's own DBAPI connection. Django's PostgreSQL backends (psycopg and
psycopg2) and its SQLite backend are supported. On SQLite, Django begins a deferred transaction
unless ``OPTIONS["transaction_mode"]`` is ``"IMMEDIATE"`` (Django 5.1+); either works: the fence
takes the write lock itself with a no-op ``UPDATE`` of the epoch row before reading it.
``"IMMEDIATE"`` is still recommended, so every write transaction of the site queues for the lock
at its start rather than failing with "database is locked" when it upgrades.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from django.db import connections, transaction

from ..fencing.wrapped import as_psycopg
from .runtime import get_ownership

if TYPE_CHECKING:
    from ..ownership.facade import Ownership


class AtomicTransaction:
    """A :class:`~weft_sync.fencing.base.HostTransaction` inside an open ``atomic`` block.

    It begins and ends nothing: ``atomic`` owns the transaction and rolls it back when the fence
    raises.
    """

    def __init__(self, using: str) -> None:
        self._wrapper = connections[using]
        self.family = str(self._wrapper.vendor)
        self.end_hooks: list[Callable[[bool], None]] = []

    def defer_end_hooks(self, hooks: list[Callable[[bool], None]]) -> None:
        """Keep the end hooks of the final writes made in the block: ``atomic`` commits later."""
        self.end_hooks.extend(hooks)

    @property
    def connection_key(self) -> object | None:
        raw: object = self._wrapper.connection
        return raw

    @property
    def result(self) -> Any:
        return self._wrapper

    def begin(self) -> bool:
        # Whatever mode the transaction began in, SQLite's write lock is taken by the fence.
        return self.family != "sqlite"

    def query(self, sql: str, params: Sequence[object]) -> list[tuple[Any, ...]]:
        inner = as_psycopg(self._wrapper.connection)
        if inner is not None:
            return inner.query(sql, params)  # never prepared (see fencing.psycopg)
        cursor = self._wrapper.connection.cursor()
        try:
            if params:
                cursor.execute(sql, tuple(params))
            else:
                cursor.execute(sql)
            return [tuple(row) for row in cursor.fetchall()] if cursor.description else []
        finally:
            cursor.close()

    def end(self, error: BaseException | None) -> None:
        return None


@contextmanager
def fenced_atomic(
    workflow_id: str, using: str = "default", *, ownership: Ownership | None = None
) -> Iterator[None]:
    """``transaction.atomic(using=using)`` that also holds the epoch fence for ``workflow_id``.

    Nested inside another ``atomic`` block it is a savepoint and still checks the fence.

    :param ownership: the engine; by default ``weft_sync.django.get_ownership()``.
    :raises EngineDeposedError: the claim is not held here; the block did not run and the
        atomic block was rolled back.
    :raises StorageCapabilityError: the alias is not on the store's database.
    """
    if ownership is None:
        ownership = get_ownership()
    assert ownership is not None
    host = AtomicTransaction(using)
    try:
        with transaction.atomic(using=using), ownership.fenced(workflow_id, host):
            yield
    except BaseException:
        _end(host.end_hooks, False)
        raise
    if host.end_hooks and connections[using].in_atomic_block:
        # A savepoint in an outer atomic block: final only when that block commits. Should it
        # roll back instead, the claim stays in the store unrenewed and expires for a redrive.
        for hook in host.end_hooks:
            transaction.on_commit(functools.partial(hook, True), using=using)
        return
    _end(host.end_hooks, True)


def _end(hooks: list[Callable[[bool], None]], committed: bool) -> None:
    for hook in hooks:
        try:
            hook(committed)
        except Exception:
            logging.getLogger(__name__).exception("a fenced_atomic end hook raised; ignored")
