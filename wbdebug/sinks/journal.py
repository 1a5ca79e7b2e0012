"""Event journal: one JSON line per event, flushed as written.

wandb buffers its run file for seconds, so a process killed right after a NaN loses what W&B had not
written; a line flushed to the OS survives the process being killed (SIGKILL included).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from wbdebug.events import Event


class JournalSink:
    """Appends every event to ``path`` (``events.jsonl``)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8", buffering=1)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def emit(self, event: Event) -> None:
        self._file.write(event.model_dump_json() + "\n")
        self._file.flush()

    def close(self, events: list[Event]) -> None:
        if not self._file.closed:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()


def read_journal(path: str | os.PathLike) -> list[Event]:
    """The events in a journal; a line cut short by a crash is skipped."""
    events = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            events.append(Event.model_validate(json.loads(line)))
        except ValueError:
            continue
    return events
