"""The ``teamdesk-tasks`` subcommands beyond migrate/health/scan, one module per area.

Each module has a ``register(subparsers)`` that adds its parsers; ``teamdesk.cli`` builds
the parser from them. Module top levels import only the standard library, so ``--help``
and ``health`` stay fast; each handler imports what it needs.
"""
