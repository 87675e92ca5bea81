"""The soak's command line and the cluster's timings (soak/README.md says why each)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from soak.chaos import KINDS
from soak.cluster import SHUTDOWN_TIMEOUT_S
from teamdesk.config import Settings

DEFAULT_TASKS, SHORT_TASKS = 3000, 200
DEFAULT_PER_KIND, SHORT_PER_KIND = 10, 2  # faults of each chosen kind (--kinds)
DEFAULT_FAULTS, SHORT_FAULTS = DEFAULT_PER_KIND * len(KINDS), SHORT_PER_KIND * len(KINDS)
# The chaos window stays 440 s (66 s short) whatever the number of kinds: each kind keeps
# its density (10 in 440 s) and the tasks their arrival rate; the mean gap shrinks instead.
# So does --kinds: 10 (2) faults of each chosen kind over the same window.
DEFAULT_WINDOW_S, SHORT_WINDOW_S = 440.0, 66.0
DEFAULT_FAULT_GAP_S = DEFAULT_WINDOW_S / DEFAULT_FAULTS  # 2.75 s with 16 kinds
SHORT_FAULT_GAP_S = SHORT_WINDOW_S / SHORT_FAULTS  # 2.06 s
DEFAULT_QUIESCE_S, SHORT_QUIESCE_S = 180.0, 120.0

EXPORT_MAX_ROWS = 300  # below a whole export team (400 tickets): "too many rows" cases
EXPORT_BATCH_SIZE = 12  # 2-17 batches per export; a long export 24-25 (soak/workload.py)
STALE_AFTER_S = 6.0
HEARTBEAT_TTL_S = 3.0
SCAN_INTERVAL_S = 1.0
# A long export: >= 50 s, and under the export's 60 s read budget (tasks/export.py); the
# short soak's is half as long (still eight heartbeat TTLs and four STALE_AFTER_S).
LONG_EXPORT_S, SHORT_LONG_EXPORT_S = 52.0, 26.0
# How long txfreeze and longterm wait for their own task to reach its hook point: it queues
# behind the workload's backlog, up to a minute and a half in the middle of a full soak's
# window (faults that stop every worker's intake - pgsqueeze, failover - add to it; at 60 s
# 8 of 10 longterm faults of a full soak found no execution in time). The short soak's
# backlog is small: waiting longer there mostly made the run longer.
TASK_WAIT_S, SHORT_TASK_WAIT_S = 120.0, 60.0
# The soak's Redis is a Sentinel group (soak/sentinel.py). The sentinels fail a master over
# once it has not answered for this long: longer than the ``redis`` fault's restart (down
# 0-2 s, then up in ~0.1 s; with the sentinels' ping a second apart they see at most ~3.3 s
# of silence), so that fault stays a reboot and ``failover`` is the one that fails over.
SENTINEL_DOWN_AFTER_MS = 5000
SENTINEL_MASTER = "soak"


@dataclass(frozen=True)
class Options:
    seed: int
    tasks: int
    faults: int
    fault_gap_s: float
    quiesce_timeout_s: float
    long_export_s: float
    task_wait_s: float
    keep: bool
    short: bool
    kinds: tuple[str, ...] = KINDS

    @property
    def window_s(self) -> float:
        return self.faults * self.fault_gap_s


def parse(argv: list[str] | None, description: str) -> Options:
    parser = argparse.ArgumentParser(prog="soak", description=description)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--tasks",
        type=int,
        help=f"tasks to submit (default {DEFAULT_TASKS}; --short {SHORT_TASKS})",
    )
    parser.add_argument(
        "--faults",
        type=int,
        help=f"faults to inject (default {DEFAULT_FAULTS}; --short {SHORT_FAULTS}; with "
        f"--kinds {DEFAULT_PER_KIND} ({SHORT_PER_KIND}) of each kind chosen)",
    )
    parser.add_argument("--short", action="store_true", help="the quick variant for make test")
    parser.add_argument("--keep", action="store_true", help="keep the database and the logs")
    parser.add_argument(
        "--fault-gap",
        type=float,
        help=f"mean seconds between faults (default {DEFAULT_FAULT_GAP_S:.2f}; --short "
        f"{SHORT_FAULT_GAP_S:.2f}; with --kinds the window over the default number of faults)",
    )
    parser.add_argument("--quiesce-timeout", type=float, help="seconds to wait for quiet")
    parser.add_argument(
        "--kinds",
        default=",".join(KINDS),
        help=f"comma-separated fault kinds to inject (default: all of {','.join(KINDS)})",
    )
    args = parser.parse_args(argv)
    short = bool(args.short)
    kinds = _kinds(parser, args.kinds)
    per_kind, window_s = (
        (SHORT_PER_KIND, SHORT_WINDOW_S) if short else (DEFAULT_PER_KIND, DEFAULT_WINDOW_S)
    )
    return Options(
        seed=args.seed,
        tasks=args.tasks or (SHORT_TASKS if short else DEFAULT_TASKS),
        faults=args.faults if args.faults is not None else per_kind * len(kinds),
        fault_gap_s=args.fault_gap or window_s / (per_kind * len(kinds)),
        quiesce_timeout_s=args.quiesce_timeout or (SHORT_QUIESCE_S if short else DEFAULT_QUIESCE_S),
        long_export_s=SHORT_LONG_EXPORT_S if short else LONG_EXPORT_S,
        task_wait_s=SHORT_TASK_WAIT_S if short else TASK_WAIT_S,
        keep=bool(args.keep),
        short=short,
        kinds=kinds,
    )


def _kinds(parser: argparse.ArgumentParser, text: str) -> tuple[str, ...]:
    kinds = tuple(k for k in text.split(",") if k)
    unknown = set(kinds) - set(KINDS)
    if unknown or not kinds:
        parser.error(f"--kinds: choose from {','.join(KINDS)}")
    return kinds


def soak_settings(database_url: str, redis_url: str, prefix: str) -> Settings:
    """Shortened timings, through configuration variables only (see soak/README.md for why).
    ``redis_url`` lists the sentinels of the master ``SENTINEL_MASTER``."""
    return Settings(
        database_url=database_url,
        redis_url=redis_url,
        broker_url=redis_url,
        redis_sentinel_master=SENTINEL_MASTER,
        queue_prefix=prefix,
        log_level="info",
        worker_instance_id="soak",
        max_task_attempts=3,
        retry_base_delay_s=1.0,  # attempts >= 1 s apart: one pgkill burst (< 1 s) hits one
        stale_after_s=STALE_AFTER_S,
        scan_interval_s=SCAN_INTERVAL_S,
        heartbeat_ttl_s=HEARTBEAT_TTL_S,
        max_recoveries=10,
        export_max_rows=EXPORT_MAX_ROWS,
        export_batch_size=EXPORT_BATCH_SIZE,
        shutdown_timeout_s=SHUTDOWN_TIMEOUT_S,
    )
