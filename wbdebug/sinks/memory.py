"""Memory sink: keeps the last rows and every event in lists, for tests and notebooks."""

from __future__ import annotations

from collections import deque

from wbdebug.events import Event


class MemorySink:
    """Bounded in-memory record: ``rows`` is a deque of (step, metrics), ``events`` a list."""

    def __init__(self, max_rows: int = 10_000) -> None:
        self.rows: deque[tuple[int, dict[str, float]]] = deque(maxlen=max_rows)
        self.events: list[Event] = []
        self.closed = False

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.rows.append((step, dict(metrics)))

    def emit(self, event: Event) -> None:
        self.events.append(event)

    def close(self, events: list[Event]) -> None:
        self.closed = True

    def steps(self) -> list[int]:
        return [step for step, _ in self.rows]

    def series(self, key: str) -> dict[int, float]:
        """``key``'s value at every logged step that has it."""
        return {step: m[key] for step, m in self.rows if key in m}
