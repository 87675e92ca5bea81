"""Test-only support: API and CLI clients, workers, queues, steady gates, services of
their own. What the bench and the soak use too (processes, databases, factories, ...)
is in the top-level ``harness`` package."""
