"""The dispatcher, inside beat: fills each queue's window from the ledger, takes runs back
from silent workers, publishes again what the broker lost, purges (docs/design.md,
"Dispatch"). It reads the workers' heartbeats through their protocol in
``teamdesk.heartbeat`` and never imports the worker package."""
