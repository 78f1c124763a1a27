"""The handle a ``Ownership.claim()`` block holds while it owns one workflow."""

from __future__ import annotations

import threading
from collections.abc import Callable

from ..errors import WorkflowClaimLostError


class ClaimHandle:
    """One claim taken by :meth:`weft_sync.Ownership.claim`, valid until its block exits.

    ``lost`` is set once this process finds the claim gone: a renewal or fenced write reported it
    lost, the block's release found that another writer had replaced it, the owning
    :class:`~weft_sync.Ownership` was closed, or the process was forked (a child holds nothing).
    It is never cleared. A takeover nobody in this process has observed yet is not visible here;
    the store-side fence of every write catches it.

    :param workflow_id: the claimed workflow.
    :param epoch: the epoch number minted by this claim's acquire (monotonic per workflow).
    :param verify: asked by :meth:`assert_held` whether the claim is still held; it sets ``lost``
        when it finds the claim gone.
    :param token: the exact epoch-key bytes this claim's acquire wrote: the epoch number and
        the random mint id of that minting, which every fence compares.
    """

    __slots__ = ("_epoch", "_lost", "_released", "_token", "_verify", "_workflow_id")

    def __init__(
        self,
        workflow_id: str,
        epoch: int,
        verify: Callable[[ClaimHandle], bool],
        *,
        token: bytes = b"",
    ) -> None:
        self._workflow_id = workflow_id
        self._epoch = epoch
        self._token = token
        self._lost = threading.Event()
        self._released = False
        self._verify = verify

    @property
    def workflow_id(self) -> str:
        """The claimed workflow."""
        return self._workflow_id

    @property
    def epoch(self) -> int:
        """The epoch this claim holds; it changes with every new owner."""
        return self._epoch

    @property
    def token(self) -> bytes:
        """The fencing token of this claim: the epoch-key bytes its acquire wrote.

        Unlike :attr:`epoch`, it is never equal for two mintings, even when a store that lost
        writes hands the same epoch number out again.
        """
        return self._token

    @property
    def lost(self) -> threading.Event:
        """Set once the claim is known to be lost; wait on it or poll ``lost.is_set()``."""
        return self._lost

    def _mark_released(self) -> None:
        # Its block ended and gave the claim back: assert_held() says so rather than "lost".
        self._released = True

    def _lose_in_child(self) -> None:
        # In a forked child the claim is the parent's: ``lost`` reads set there. A new Event,
        # since a parent thread may have held the inherited one's lock at fork time.
        lost = threading.Event()
        lost.set()
        self._lost = lost

    def assert_held(self) -> None:
        """Return if this process still holds the claim at this epoch; call before side effects.

        Reads only this process's claim registry (no storage round trip). A claim with no
        successful renewal for ``claim_ttl - claim_renew_interval`` is lost here (one
        claim-lost warning, ``on_lost``), before its holder record can expire in the store.

        :raises WorkflowClaimLostError: the claim was lost, or its block has ended (then with
            ``released`` true).
        """
        if not self._lost.is_set() and self._verify(self):
            return
        if self._released and not self._lost.is_set():
            raise WorkflowClaimLostError(self._workflow_id, released=True)
        raise WorkflowClaimLostError(self._workflow_id)

    def __repr__(self) -> str:
        state = "lost" if self._lost.is_set() else "live"
        return f"ClaimHandle({self._workflow_id!r}, epoch={self._epoch}, {state})"
