"""The bodies of the ``weft-sync`` commands; each returns an exit code and writes to ``out``.

Read-only commands (``claims``, ``workflows``, ``show``, ``status``, ``metrics``, ``doctor``
without ``--fix``) open the store with ``read_only=True``: they never create a file, a table or
a lock file, and never write.
"""

from __future__ import annotations

from .doctor import doctor as doctor
from .listing import claims as claims
from .listing import show as show
from .listing import workflows as workflows
from .maintain import StopSignals as StopSignals
from .maintain import maintain as maintain
from .operate import cancel as cancel
from .operate import demo as demo
from .operate import release as release
from .operate import repair_epoch as repair_epoch
from .output import CommandError as CommandError
from .output import NotFound as NotFound
from .output import StoreMissing as StoreMissing
from .output import StoreRef as StoreRef
from .output import UsageError as UsageError
from .output import one_line as one_line
from .store_view import metrics as metrics
from .store_view import status as status
