"""The HTTP API (docs/design.md, "HTTP API"): health probes and the task routes, on FastAPI.

``api.app:app`` is the ASGI application uvicorn serves; :func:`api.app.create_api`
builds one for explicit settings (tests). The API never runs SQL of its own except the
health check's ``SELECT 1``: every task route is one short transaction through
:mod:`ledger.service` (a creation: two statements, each its own transaction, see
api/tasks.py), and it never waits on a worker (a new task is a WAITING row that
the dispatcher publishes at once).
"""
