"""The task ledger: the only code that knows lease conditions and state transitions."""
