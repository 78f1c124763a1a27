"""gunicorn settings for the Flask example: every worker releases its claims as it exits.

Use with ``gunicorn -c examples/flask_app/gunicorn.conf.py 'examples.flask_app.app:create_app()'``
(add ``-w``, ``-b`` and ``--preload`` as you like: the ``Ownership`` opens in each worker).
"""

from weft_sync.flask import gunicorn_worker_exit as worker_exit

__all__ = ["worker_exit"]
