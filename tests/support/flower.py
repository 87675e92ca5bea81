"""Reading a real Flower the tests start: whether it sees a worker yet."""

from __future__ import annotations

import urllib.request


def flower_sees_worker(port: int, node: str = "w1") -> bool:
    """Whether Flower on ``port`` counts worker ``node`` online. /metrics answers without
    credentials even with basic auth on (deploy/operations.md, "Flower")."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            metrics = response.read().decode()
    except OSError:
        return False
    return f'flower_worker_online{{worker="{node}@' in metrics
