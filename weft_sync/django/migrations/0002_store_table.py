"""Create the weft_sync store's table when ``settings.WEFT_SYNC`` names a ``DATABASES`` alias.

``migrate`` runs this on each database it migrates; it acts only on the alias that
``WEFT_SYNC["DATABASE"]`` names, where it opens the store once (which creates its table, as
the first ``Ownership.open`` would) and closes it again. With ``WEFT_SYNC["URL"]`` (a store
outside Django's databases), or no ``WEFT_SYNC`` at all, it does nothing: that store is created
when it is first opened. Reversing it drops nothing (the table holds the claims of running
workflows). Not atomic: on SQLite the store opens its own connection to the file, which must
not wait for a write transaction of the migration's connection.
"""

from __future__ import annotations

from typing import Any, ClassVar

from django.conf import settings
from django.db import migrations


def create_store_table(apps: Any, schema_editor: Any) -> None:
    raw = getattr(settings, "WEFT_SYNC", None)
    if not isinstance(raw, dict) or raw.get("DATABASE") != schema_editor.connection.alias:
        return
    from weft_sync.django.conf import load_config
    from weft_sync.storage import open_storage

    storage = open_storage(load_config().url)
    storage.close()


class Migration(migrations.Migration):
    atomic = False
    dependencies: ClassVar[list[Any]] = [("weft_sync", "0001_initial")]

    operations: ClassVar[list[Any]] = [
        migrations.RunPython(create_store_table, migrations.RunPython.noop, elidable=True),
    ]
