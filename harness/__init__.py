"""Helpers the tests, the bench and the soak share: processes (real cluster subprocesses
and their settings), databases (per-run PostgreSQL clones of a migrated template),
waiting (polling until a condition holds), csv reference (an export's expected CSV,
computed independently of the export code), factories (business rows inserted with plain
SQL) and remote gates (pausing real worker subprocesses at hook points, through Redis).
No shipped package imports it; it is not part of the installed distribution."""
