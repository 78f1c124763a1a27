"""Key layout: every key the library writes, and the strict key-component codec.

Workflow ids are percent-encoded with JavaScript ``encodeURIComponent`` rules, so every key is
ASCII and byte order equals code-unit order on every backend.
"""

from __future__ import annotations

import re
from typing import Final
from urllib.parse import quote

__all__ = [
    "OWNERSHIP_MODE_MARKER",
    "OWNER_INDEX_MARKER",
    "decode_canonical_component",
    "decode_key_component",
    "decode_owner_by_engine_key",
    "encode_key_component",
    "engine_liveness",
    "try_decode_key_component",
    "validate_workflow_id",
    "workflow",
    "workflow_owner_by_engine",
    "workflow_owner_by_engine_prefix",
    "workflow_owner_epoch",
    "workflow_owner_holder",
    "workflow_status_index",
]

OWNERSHIP_MODE_MARKER: Final = "ownership-mode-marker"
OWNER_INDEX_MARKER: Final = "wf-owner-index-marker"
"""Set once every holder of the store has its by-engine entry (see
:mod:`weft_sync.claims.engine_index`)."""
MAX_WORKFLOW_ID_LENGTH: Final = 1024

_UNRESERVED: Final = "-_.!~*'()"
_ESCAPE = re.compile(r"%([0-9A-Fa-f]{2})")
# A run of characters encode_key_component leaves as they are: such a component is its own
# decoding and its own (canonical) encoding.
_VERBATIM = re.compile(r"[A-Za-z0-9\-_.!~*'()]*")


def encode_key_component(s: str) -> str:
    """Percent-encode ``s`` as JavaScript ``encodeURIComponent`` does (uppercase hex, UTF-8).

    :raises TypeError: ``s`` is not a ``str``.
    :raises ValueError: ``s`` holds a lone surrogate, which has no UTF-8 form.
    """
    if not isinstance(s, str):
        raise TypeError(f"key components must be str, got {type(s).__name__} {s!r}")
    if _VERBATIM.fullmatch(s):
        return s  # nothing to escape (the usual id): one regex match instead of quote()
    try:
        return quote(s, safe=_UNRESERVED, encoding="utf-8", errors="strict")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{s!r} cannot be used in a key: it contains a lone surrogate at index {exc.start}"
        ) from None


def decode_key_component(s: str) -> str:
    """Reverse :func:`encode_key_component` strictly (``decodeURIComponent`` rules).

    Every ``%`` must start a two-hex-digit escape and the escaped bytes must be valid UTF-8;
    ``+`` stays ``+``.

    :raises ValueError: ``s`` is malformed.
    """
    decoded = try_decode_key_component(s)
    if decoded is None:
        raise ValueError(
            f"malformed key component {s!r}: every '%' must begin a two-digit hex escape and "
            f"the escaped bytes must be valid UTF-8"
        )
    return decoded


def try_decode_key_component(s: str) -> str | None:
    """Like :func:`decode_key_component` but return ``None`` instead of raising."""
    if "%" not in s:
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            return None
        return s
    out = bytearray()
    pos = 0
    try:
        while pos < len(s):
            nxt = s.find("%", pos)
            if nxt < 0:
                out += s[pos:].encode("utf-8")
                break
            out += s[pos:nxt].encode("utf-8")
            match = _ESCAPE.match(s, nxt)
            if match is None:
                return None
            out.append(int(match.group(1), 16))
            pos = match.end()
        return out.decode("utf-8", errors="strict")
    except UnicodeError:
        return None


def decode_canonical_component(s: str) -> str | None:
    """The string ``s`` encodes, if ``s`` is exactly :func:`encode_key_component` of it.

    ``None`` for a malformed component and for a well-formed but non-canonical one (a lowercase
    or needless escape, or a character that must be escaped: ``wf:<id>:ckpt`` under the prefix
    ``wf:`` is not a component). Components made only of unreserved characters, as most ids
    are, are recognised without decoding.
    """
    if _VERBATIM.fullmatch(s) is not None:
        return s
    decoded = try_decode_key_component(s)
    if decoded is None or encode_key_component(decoded) != s:
        return None
    return decoded


def validate_workflow_id(workflow_id: object) -> str:
    """Return ``workflow_id`` if it can name a workflow, else raise naming the problem.

    :raises TypeError: not a ``str``.
    :raises ValueError: empty, longer than 1024 characters, or holding a lone surrogate.
    """
    if not isinstance(workflow_id, str):
        raise TypeError(
            f"workflow ids must be str, got {type(workflow_id).__name__} {workflow_id!r:.80}"
        )
    if not workflow_id:
        raise ValueError("workflow id must be a non-empty string, got ''")
    if len(workflow_id) > MAX_WORKFLOW_ID_LENGTH:
        raise ValueError(
            f"workflow id {workflow_id[:40]!r}... is {len(workflow_id)} characters long; the "
            f"limit is {MAX_WORKFLOW_ID_LENGTH}"
        )
    try:
        workflow_id.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"workflow id {workflow_id!r:.80} contains a lone surrogate at index {exc.start}; "
            f"ids must be valid Unicode text"
        ) from None
    return workflow_id


def workflow_owner_epoch(workflow_id: str) -> str:
    """Key of the workflow's epoch (the fencing token); never deleted."""
    return "wf-owner-epoch:" + encode_key_component(workflow_id)


def workflow_owner_holder(workflow_id: str) -> str:
    """Key of the workflow's holder record (who owns it, until when)."""
    return "wf-owner-holder:" + encode_key_component(workflow_id)


_BY_ENGINE: Final = "wf-owner-by-engine:"


def workflow_owner_by_engine(engine_id: str, workflow_id: str) -> str:
    """Key of the by-engine entry saying ``engine_id`` holds ``workflow_id``'s claim."""
    return _BY_ENGINE + encode_key_component(engine_id) + ":" + encode_key_component(workflow_id)


def workflow_owner_by_engine_prefix(engine_id: str) -> str:
    """Prefix of every by-engine entry of ``engine_id``.

    Engine ids are never empty, so ``""`` gives the prefix of every engine's entries.
    """
    if engine_id == "":
        return _BY_ENGINE
    return _BY_ENGINE + encode_key_component(engine_id) + ":"


def decode_owner_by_engine_key(key: str) -> tuple[str, str] | None:
    """Return ``(engine_id, workflow_id)`` of a by-engine entry key, or ``None``.

    ``None`` unless ``key`` is exactly what :func:`workflow_owner_by_engine` builds: both
    components non-empty, well-formed and in canonical encoding.
    """
    if not isinstance(key, str) or not key.startswith(_BY_ENGINE):
        return None
    parts = key[len(_BY_ENGINE) :].split(":")
    if len(parts) != 2:
        return None
    engine_id, workflow_id = (decode_canonical_component(part) for part in parts)
    if not engine_id or not workflow_id:
        return None
    return engine_id, workflow_id


def workflow(workflow_id: str) -> str:
    """Key of the workflow's state record."""
    return "wf:" + encode_key_component(workflow_id)


def workflow_status_index(status: str, workflow_id: str) -> str:
    """Key of the workflow's entry in the status index."""
    return "wf-idx-status:" + encode_key_component(status) + ":" + encode_key_component(workflow_id)


def engine_liveness(engine_id: str) -> str:
    """Key of an engine's liveness record (its heartbeat); ``""`` gives the prefix."""
    return "wf-owner-engine:" + encode_key_component(engine_id)
