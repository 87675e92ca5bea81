"""``make soak``: a chaos run of the whole cluster that checks every ledger invariant.

See ``soak/README.md``. Entry point: ``python -m soak.run``.
"""
