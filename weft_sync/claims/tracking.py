"""What the claim registry tracks per held workflow, and the one lock that guards it.

:class:`ClaimTable` is the registry's whole mutable state; the registry and its renewal and
release parts share one table. Its lock guards the claims map, the in-flight renewal groups, the
releasing counts and the mutable fields (``holder_bytes``, ``pending``, ``renewed``,
``renewed_at``) of every tracked entry.
The lock is never held across storage I/O, clock reads, warning sinks or logging.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Final

from .cooldown import TakeoverCooldown
from .holder_splice import renewal_split
from .results import RenewResult

PENDING_LIMIT: Final = 8
"""Holder values kept per claim from renewals whose commit raised (see ``TrackedClaim``)."""


@dataclass(eq=False, slots=True)
class TrackedClaim:
    """One held claim. Compared by identity: each acquire or takeover installs a new object.

    ``holder_bytes`` is what the store held at ``holder_key`` after this engine's last confirmed
    write. A renewal rewrites only the ``expires_at`` value: ``head_len`` bytes before it and
    ``tail_len`` bytes after it stay as they are (``head_len == 0``: renew through
    ``build_renew_transition``). They are found at the first renewal (:meth:`splice_lengths`),
    so a claim released before it renews never pays for the search.

    ``pending`` holds the values of renewals whose commit raised: any one of them may have
    committed all the same (a connection lost during COMMIT). Each of those renewals was
    conditioned on ``holder_bytes``, so at most one of them landed; the first and the latest
    values are kept, at most :data:`PENDING_LIMIT` in all. A confirmed write empties it.

    ``renewed`` is the ``renewed`` result of this claim, made at its first successful renewal
    and returned by every later one (results are immutable, so one object serves them all).

    ``renewed_at`` is the clock reading that started the last successful write of the holder
    (acquire, takeover or renewal): the local renew deadline counts from it.
    """

    epoch: int
    claimed_at: int
    epoch_bytes: bytes
    holder_bytes: bytes
    holder_key: str
    head_len: int = -1
    """``-1`` until :meth:`splice_lengths` looked."""
    tail_len: int = 0
    pending: tuple[bytes, ...] = ()
    renewed: RenewResult | None = None
    renewed_at: int = -1

    def __post_init__(self) -> None:
        if self.renewed_at < 0:
            self.renewed_at = self.claimed_at

    def splice_lengths(self) -> tuple[int, int]:
        """``(head_len, tail_len)``, found in ``holder_bytes`` on the first call.

        Every renewal keeps the bytes around ``expires_at``, so the lengths found in any holder
        value of this claim hold for all of them. Two threads may both look; they find the same.
        """
        if self.head_len < 0:
            self.head_len, self.tail_len = renewal_split(self.holder_bytes)
        return self.head_len, self.tail_len

    def remember_pending(self, value: bytes) -> None:
        """Add the value of a renewal whose commit raised. Call with the table lock held."""
        if value in self.pending:
            return
        if len(self.pending) < PENDING_LIMIT:
            self.pending = (*self.pending, value)
        else:
            self.pending = (self.pending[0], *self.pending[2:], value)


class RenewalGroup:
    """Renewals committed together; callers joining one of them wait on ``done``.

    ``results``, ``errors`` and ``error`` are written before ``done`` is set and never after it.
    ``error`` fails every renewal of the group; ``errors`` fails single ids.
    """

    __slots__ = ("done", "error", "errors", "results")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.results: dict[str, RenewResult] = {}
        self.errors: dict[str, BaseException] = {}
        self.error: BaseException | None = None

    def result(self, workflow_id: str) -> RenewResult:
        """Wait for the group; return the id's result or raise its error."""
        self.done.wait()
        error = self.error if self.error is not None else self.errors.get(workflow_id)
        if error is not None:
            raise error
        return self.results[workflow_id]

    def outcome(self, workflow_id: str) -> RenewResult | Exception:
        """Like :meth:`result`, but return an ``Exception`` instead of raising it."""
        try:
            return self.result(workflow_id)
        except Exception as exc:
            return exc


class ClaimTable:
    """The registry's tracking state (see the module docstring for what ``lock`` guards).

    :param cooldown_window_ms: the takeover cooldown window (the claim renew interval).
    """

    def __init__(self, cooldown_window_ms: int) -> None:
        self._cooldown_window_ms = cooldown_window_ms
        # lock guards claims, in_flight, releasing and the mutable fields of tracked entries.
        self.lock = threading.Lock()
        self.claims: dict[str, TrackedClaim] = {}
        self.in_flight: dict[str, RenewalGroup] = {}
        self.releasing: dict[str, int] = {}
        self.cooldown = TakeoverCooldown(cooldown_window_ms)
        # Set (under lock) once the registry's final release began: no claim is tracked after.
        self.closed = False

    def reset(self) -> None:
        """Replace everything with fresh, empty state (a new lock, claims, cooldown).

        For a forked child: a parent thread may have held the lock at fork time, so the state is
        replaced rather than cleared under that lock.
        """
        self.lock = threading.Lock()
        self.claims = {}
        self.in_flight = {}
        self.releasing = {}
        self.cooldown = TakeoverCooldown(self._cooldown_window_ms)
        self.closed = False

    def get(self, workflow_id: str) -> TrackedClaim | None:
        with self.lock:
            return self.claims.get(workflow_id)

    def install(self, workflow_id: str, entry: TrackedClaim) -> bool:
        """Track ``entry`` (replacing any older one) and end the id's takeover cooldown.

        :returns: ``False`` (nothing tracked) once ``closed`` is set.
        """
        with self.lock:
            if self.closed:
                return False
            self.claims[workflow_id] = entry
            self.cooldown.clear(workflow_id)
            return True

    def drop_if_same(self, workflow_id: str, entry: TrackedClaim) -> bool:
        """Stop tracking ``workflow_id`` if ``entry`` is still its entry; say whether it was."""
        with self.lock:
            if self.claims.get(workflow_id) is entry:
                del self.claims[workflow_id]
                return True
            return False

    def adopt_pending(self, workflow_id: str, entry: TrackedClaim, observed: bytes | None) -> bool:
        """Make ``observed`` (the holder just read) ``entry``'s holder if it is a pending value.

        Only while ``entry`` is still tracked; the pending values are dropped on adoption.

        :returns: whether ``observed`` was adopted.
        """
        with self.lock:
            if observed is None or self.claims.get(workflow_id) is not entry:
                return False
            if observed not in entry.pending:
                return False
            entry.holder_bytes = observed
            entry.pending = ()
            return True

    def begin_release(self, workflow_id: str) -> RenewalGroup | None:
        """Mark ``workflow_id`` releasing (renewals now return ``not-held``).

        :returns: the renewal in flight for it, which the caller waits for, or ``None``.
        """
        with self.lock:
            self.releasing[workflow_id] = self.releasing.get(workflow_id, 0) + 1
            return self.in_flight.get(workflow_id)

    def end_release(self, workflow_id: str) -> None:
        """Undo one :meth:`begin_release`."""
        with self.lock:
            self.end_release_locked(workflow_id)

    def end_release_locked(self, workflow_id: str) -> None:
        """:meth:`end_release` for a caller that holds the lock."""
        remaining = self.releasing.get(workflow_id, 0) - 1
        if remaining > 0:
            self.releasing[workflow_id] = remaining
        else:
            self.releasing.pop(workflow_id, None)
