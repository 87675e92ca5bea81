"""The HTTP API on FastAPI (docs/design.md, "HTTP API"); ``api.app:app`` is the ASGI app.

No SQL of its own but the health check's ``SELECT 1``: task routes go through :mod:`ledger.service`.
"""
