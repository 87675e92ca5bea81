"""The ``teamdesk-tasks`` subcommands beyond migrate/health/scan, each module with a
``register(subparsers)``.

Top levels import only the standard library and ``teamdesk.config``/``teamdesk.logs``;
handlers import the heavy rest when they run, so ``--help`` and the ``health`` probe (4 s
budget) stay fast. The project's only imports inside functions (tests/unit/test_architecture.py).
"""
