"""Every error the dispatcher raises. Messages are fixed; they never echo a driver's text
(which may hold an address or a password)."""

from __future__ import annotations


class DispatcherError(Exception):
    """Dispatcher error."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class ScanUnavailable(DispatcherError):
    """The scan could not reach a service it needs; nothing half-done was committed."""

    def __init__(self, service: str, error: str) -> None:
        super().__init__(f"cannot reach {service} ({error})")
        self.service = service
        self.error = error
