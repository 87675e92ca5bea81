"""``make bench``: side-by-side performance ratios for the TeamDesk task cluster.

See bench/README.md.
"""

NOOP_TASK = "bench.noop"  # the bare baseline task, registered by bench.worker_hooks in workers
FLUSH_EVERY_S = 0.2  # how often a pool child writes its stats file
