"""gunicorn settings for the Flask example: each worker opens its ``Ownership`` as it boots and
releases its claims as it exits.

Use with ``gunicorn -c examples/flask_app/gunicorn.conf.py 'examples.flask_app.app:create_app()'``
(add ``-w``, ``-b`` and ``--preload`` as you like). Opening at boot makes every worker renew,
watch for crashed workers and take their jobs over before it serves a request, rather than from
its first request that uses the store. Nothing is opened in the master, with or without
``--preload``.
"""

from weft_sync.flask import gunicorn_post_worker_init as post_worker_init
from weft_sync.flask import gunicorn_worker_exit as worker_exit

__all__ = ["post_worker_init", "worker_exit"]
