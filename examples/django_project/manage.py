#!/usr/bin/env python
"""Django's command-line utility for the example project.

cd examples/django_project
python manage.py weft_maintain --once                       # one pass, then exit (cron)
python manage.py weft_maintain --interval                   # until SIGTERM or Ctrl-C
python manage.py weft_maintain --once --demo                # leave an abandoned report first
python manage.py weft_maintain --url postgresql://app@db/app --once
"""

from __future__ import annotations

import os
import sys


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "weftsite.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
