"""Gates: make an execution stop at a named point until the test lets it go.

A gate's ``wait`` has a timeout only to detect a point that was never reached; the test
always releases gates in ``finally`` so a failed assertion cannot leave a thread parked.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

GATE_TIMEOUT_S = 20.0


class Gate:
    """Parks one execution at a hook point until released."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.reached = threading.Event()
        self.released = threading.Event()
        self.context: dict[str, Any] = {}

    def hook(
        self, when: Callable[..., bool] | None = None, then: Callable[..., None] | None = None
    ) -> Callable[..., None]:
        """A hook that parks the first execution matching ``when`` here, then runs ``then``
        in it; every other execution passes straight through."""
        taken = threading.Lock()

        def park(**context: Any) -> None:
            if when is not None and not when(**context):
                return
            if not taken.acquire(blocking=False):
                return
            self.context = context
            self.reached.set()
            if not self.released.wait(GATE_TIMEOUT_S):
                raise TimeoutError(f"gate {self.name} was never released")
            if then is not None:
                then(**context)

        return park

    def wait_reached(self, timeout: float = GATE_TIMEOUT_S) -> None:
        if not self.reached.wait(timeout):
            raise AssertionError(f"gate {self.name} was never reached")

    def release(self) -> None:
        self.released.set()
