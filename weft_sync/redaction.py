"""Hide credentials in store URLs and in any text that may quote one.

Every message, banner and error that can show a store URL passes it through :func:`redact_url`
(one URL) or :func:`redact_text` (free text, such as a driver's error message), so a password in
``postgresql://user:secret@host/db``, in a ``?password=`` query parameter or in a libpq
``password=…`` keyword string is never printed or logged.
"""

from __future__ import annotations

import re
from typing import Final

MASK: Final = "***"

# ``scheme://user:password@`` — the password is everything between the first ':' after the
# scheme and the last '@' of the authority (a password may itself contain '@' or ':').
_USERINFO: Final = re.compile(
    r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^:/?#@\s]*:)(?P<secret>[^/?#\s]*)@"
)
# ``password=…`` as a URL query parameter (up to '&' or '#') or as a libpq keyword (up to a
# space, or a quoted value). ``sslpassword`` and friends end in "password" too.
_PASSWORD_PARAM: Final = re.compile(
    r"(?P<head>\b[A-Za-z_]*(?:password|passwd)\s*=\s*)"
    r"(?P<secret>'(?:[^'\\]|\\.)*'|[^&#\s'\"]+)",
    re.IGNORECASE,
)


def redact_url(url: str) -> str:
    """Return ``url`` with its password replaced by ``***``; other parts stay readable.

    ``postgresql://user:secret@host/db?password=x`` becomes
    ``postgresql://user:***@host/db?password=***``. A URL without credentials is returned
    unchanged, so it is safe to call on every URL before showing it.
    """
    return redact_text(url)


def redact_text(text: str) -> str:
    """Return ``text`` with every password of a URL or connection string in it masked."""
    masked = _USERINFO.sub(lambda m: f"{m['head']}{MASK}@", text)
    return _PASSWORD_PARAM.sub(lambda m: f"{m['head']}{MASK}", masked)
