"""The ``teamdesk-tasks`` subcommands beyond migrate/health/scan, one module per area.

Each module has a ``register(subparsers)`` that adds its parsers; ``cli.main`` builds
the parser from them. Module top levels import only the standard library and the light
foundation (``teamdesk.config``, ``teamdesk.logs``); each handler imports the heavy
rest (SQLAlchemy, the ledger, Celery, alembic, uvicorn) when it runs, so ``--help`` and
the ``health`` probe (a 4 s budget) never pay for what they do not use. These are the
project's only imports inside functions (tests/unit/test_architecture.py checks it).
"""
