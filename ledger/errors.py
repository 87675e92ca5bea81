"""Every error the ledger raises. User-facing text is fixed; it never echoes input."""

from __future__ import annotations


class LedgerError(Exception):
    """Ledger error."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())

    @property
    def message(self) -> str:
        return str(self)


class LeaseLost(LedgerError):
    """This execution no longer holds the task's lease; a newer one owns it."""

    def __init__(self, task_id: object = None) -> None:
        super().__init__()
        self.task_id = task_id


class TaskRejected(LedgerError):
    """The task cannot succeed as asked; waiting will not fix it."""


class InvalidFilters(TaskRejected):
    """The export filters are invalid."""


class PermissionLost(TaskRejected):
    """The owner may no longer run this task."""


class TooManyRows(TaskRejected):
    """The export matches more rows than allowed; narrow the filters."""


class CsvTooLarge(TaskRejected):
    """The export's CSV would be larger than allowed; narrow the filters."""


MSG_TEAM_FULL = (
    "this team has too many unfinished tasks (waiting or running); "
    "try again when some have finished, or cancel some"
)


class TeamQuotaExceeded(LedgerError):
    """This team has too many unfinished tasks (waiting or running); try again later."""

    def __init__(self) -> None:
        super().__init__(MSG_TEAM_FULL)


class ExportQuotaExceeded(LedgerError):
    """This team reached its daily export quota; try again later."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class InvalidInput(LedgerError):
    """The request is invalid."""


class NotFound(LedgerError):
    """Task not found."""


class NotAllowed(LedgerError):
    """You may not do this to this task."""


class InvalidState(LedgerError):
    """The task is not in a state that allows this."""
