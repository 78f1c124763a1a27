"""Where a store URL points: what the command line checks before and after opening a store.

Before: the ports and ``sslmode`` of a PostgreSQL URL, which libpq refuses only when asked to
connect, in an error that reads like a failed store; here they are usage errors naming the value.
After an open failed: whether this process may reach the SQLite file through its directories
(a directory it may not search makes the file look absent), and whether any PostgreSQL server
the URL names accepts a connection at all, so the error says which of these went wrong.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final
from urllib.parse import parse_qsl, unquote, urlsplit

from ...redaction import redact_url

SSL_MODES: Final = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")
"""The values libpq takes for ``sslmode``."""

DEFAULT_PORT: Final = 5432
PROBE_TIMEOUT_S: Final = 3.0
"""How long a server named by the URL is given to accept a connection, after an open failed."""

# libpq reads a port with strtol (leading blanks and a sign allowed), then takes 1 .. 65535.
_PORT: Final = re.compile(r"\s*[+-]?\d+\s*")
_EFFECTIVE_IDS: Final = os.access in os.supports_effective_ids


def is_postgres(url: str) -> bool:
    """Whether ``url`` names a PostgreSQL store."""
    return url.partition("://")[0].lower() in ("postgresql", "postgres")


def sqlite_path(url: str) -> str | None:
    """The file a ``sqlite:///`` URL names, as the store resolves it; ``None`` for other URLs."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() != "sqlite":
        return None
    location = rest.partition("?")[0]
    return location[1:] if location.startswith("/") and len(location) > 1 else None


def sqlite_access_problem(path: str) -> str | None:
    """Why this process cannot reach the file at ``path``, or ``None`` when nothing stops it.

    A directory on the way that this process may not search hides the file: to every check
    that does not say why (``os.path.isfile``), it does not exist.
    """
    target = os.path.abspath(path)
    try:
        os.stat(target)
    except PermissionError:
        return _unsearchable(target)
    except OSError:
        return None  # absent (or worse): the store's own error says so
    if os.path.isfile(target) and not os.access(target, os.R_OK, effective_ids=_EFFECTIVE_IDS):
        return f"permission denied: this process may not read the file {target!r}"
    return None


def _unsearchable(target: str) -> str:
    """The permission error for ``target``, naming the directory that may not be searched."""
    # Walk down from the root: the first entry that cannot be looked up is in a directory this
    # process may not search (every directory above it could be).
    directory = os.sep
    for name in target.split(os.sep)[1:]:
        entry = os.path.join(directory, name)
        try:
            os.stat(entry)
        except PermissionError:
            return (
                f"permission denied: this process may not search the directory {directory!r} "
                f"(on the way to {target!r})"
            )
        except OSError:
            break
        directory = entry
    return f"permission denied: this process may not reach {target!r}"


def check_postgres_url(url: str) -> None:
    """Refuse a PostgreSQL URL whose ports or ``sslmode`` libpq would refuse.

    :raises ValueError: a port that is not a whole number from 1 to 65535, or an unknown
        ``sslmode``; the message names the value and the valid ones.
    """
    shown = redact_url(url)
    try:
        parts = urlsplit(url)
    except ValueError:
        return  # malformed: open_storage names the problem
    query = parse_qsl(parts.query, keep_blank_values=True)
    for host, port in _netloc_hosts(parts.netloc):
        where = f" of host {host!r}" if host else ""
        _check_port(port, f"port {port!r}{where} in {shown!r}")
    for name, value in query:
        if name == "port":
            for port in value.split(","):
                _check_port(port, f"parameter port={value!r} in {shown!r}")
        elif name == "sslmode" and value not in SSL_MODES:
            raise ValueError(
                f"parameter sslmode={value!r} in {shown!r} is not one of {', '.join(SSL_MODES)}"
            )


def _check_port(port: str, what: str) -> None:
    if not port:
        return  # the default port
    if not _PORT.fullmatch(port):
        raise ValueError(f"{what} is not a number; a port is a whole number from 1 to 65535")
    if not 1 <= int(port) <= 65535:
        raise ValueError(f"{what} is out of range; a port is a whole number from 1 to 65535")


def _netloc_hosts(netloc: str) -> list[tuple[str, str]]:
    """``(host, port)`` of each host of a URL's authority; either may be empty."""
    hostspec = netloc.rpartition("@")[2]
    if not hostspec:
        return []
    found: list[tuple[str, str]] = []
    for item in hostspec.split(","):
        if item.startswith("["):
            address, _, rest = item[1:].partition("]")
            found.append((address, rest[1:] if rest.startswith(":") else ""))
        else:
            host, _, port = item.partition(":")
            found.append((unquote(host), port))
    return found


@dataclass(frozen=True)
class Endpoint:
    """A place a PostgreSQL server listens: a host and port, or a socket directory and port."""

    host: str
    port: int

    @property
    def is_socket(self) -> bool:
        return self.host.startswith("/")

    def __str__(self) -> str:
        if self.is_socket:
            return f"socket {os.path.join(self.host, f'.s.PGSQL.{self.port}')}"
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def refusal(self, timeout: float) -> str | None:
        """Why nothing accepts a connection here, or ``None`` once something does.

        Opens and closes a connection without sending anything, as a service monitor does.
        """
        try:
            if self.is_socket:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                    sock.settimeout(timeout)
                    sock.connect(os.path.join(self.host, f".s.PGSQL.{self.port}"))
            else:
                socket.create_connection((self.host, self.port), timeout=timeout).close()
        except socket.gaierror as exc:
            return f"host name not found ({exc.strerror})"
        except TimeoutError:
            return f"no answer within {timeout:g} s"
        except OSError as exc:
            return (exc.strerror or str(exc)).lower()
        return None


def postgres_endpoints(url: str) -> list[Endpoint]:
    """Where the servers a PostgreSQL URL names listen; empty when that is not known here.

    Hosts and ports come from the URL (its ``host``, ``hostaddr`` and ``port`` parameters
    over its authority), then ``$PGHOST`` and ``$PGPORT``. A URL that names no host at all
    leaves libpq's compiled-in socket directory, which is not known here.
    """
    try:
        parts = urlsplit(url)
    except ValueError:
        return []
    params = dict(parse_qsl(parts.query, keep_blank_values=True))
    pairs = _netloc_hosts(parts.netloc)
    hosts = [host for host, _ in pairs] or [""]
    ports = [port for _, port in pairs] or [""]
    for name in ("host", "hostaddr"):
        if params.get(name):
            hosts = params[name].split(",")
    if params.get("port"):
        ports = params["port"].split(",")
    hosts = [host or os.environ.get("PGHOST", "") for host in hosts]
    if len(ports) == 1:
        ports = ports * len(hosts)
    if len(ports) != len(hosts) or not all(hosts):
        return []
    default = os.environ.get("PGPORT", str(DEFAULT_PORT))
    found: list[Endpoint] = []
    for host, port in zip(hosts, ports, strict=True):
        number = (port or default).strip()
        if not number.isdigit():
            return []
        found.append(Endpoint(host, int(number)))
    return found


def unreachable(endpoints: Sequence[Endpoint], timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """How each of ``endpoints`` failed to accept a connection, or ``None`` if one accepted
    (or there are none to try)."""
    reasons: list[str] = []
    for endpoint in endpoints:
        reason = endpoint.refusal(timeout)
        if reason is None:
            return None
        reasons.append(f"{endpoint}: {reason}")
    return "; ".join(reasons) if reasons else None
