"""Tidying up after an engine that is gone: its record and what its lock left behind."""

from __future__ import annotations

from ..keys import engine_liveness
from ..storage import Condition, Delete, Storage, storage_conditional_batch
from ..storage.session_locks import storage_session_locks
from .verdicts import EngineStatus, EngineVerdict

_FORGETTABLE = (EngineVerdict.CRASHED, EngineVerdict.CLOSED)


def forget_engine(storage: Storage, status: EngineStatus) -> bool:
    """Delete a crashed or closed engine's record, if it is still exactly as surveyed.

    The caller decides that the engine has no claims left. The delete is conditioned on the
    record's exact bytes, so an engine that wrote again since (it was not dead after all: a
    PostgreSQL lock session cut by a partition) keeps its record. Once the record is gone, what
    its session lock left behind is removed (a no-op while the lock is held).

    :returns: whether the record was deleted.
    :raises ValueError: the status is not ``CRASHED`` or ``CLOSED``.
    :raises StorageError: the delete or the tidy-up failed.
    """
    if status.verdict not in _FORGETTABLE:
        raise ValueError(
            f"only crashed or closed engines are forgotten; engine {status.engine_id!r} is "
            f"{status.verdict.value}"
        )
    key = engine_liveness(status.engine_id)
    if not storage_conditional_batch(storage, [Condition(key, status.raw)], [Delete(key)]):
        return False
    locks = storage_session_locks(storage)
    if locks is not None and status.record is not None and status.record.lock is not None:
        locks.forget_session_lock(status.record.lock)
    return True
