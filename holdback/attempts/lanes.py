"""Database lanes: threads that run the attempts' transactions off the event loop (SQLAlchemy's engine is
synchronous), every call queued while a lane was busy sharing its next transaction (group commit)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker
from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from holdback.db import transaction
from holdback.results import deferred_batch_counts

T = TypeVar("T")


class DatabaseLane:
    """One thread that runs database work in groups: every call queued while the thread was busy shares the
    next transaction (group commit), so N attempts cost one BEGIN/COMMIT instead of N.

    The group's batch counter updates are applied once per batch at its end (`deferred_batch_counts`), so
    the hot batch row is locked only for the commit. If a group's transaction fails, each call of it runs
    again alone in its own transaction (retried while
    the database is busy or away), so one bad call never fails the others.
    """

    def __init__(self, sessions: sessionmaker[Session], name: str, max_group: int = 64):
        self.sessions = sessions
        self.max_group = max_group
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future:
        future: Future = Future()
        self._queue.put((fn, args, future))
        return future

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(10)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            group = [item]
            while len(group) < self.max_group:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._queue.put(None)  # finish this group, then stop
                    break
                group.append(more)
            group = [g for g in group if g[2].set_running_or_notify_cancel()]
            if group:
                self._run_group(group)

    def _run_group(self, group: list) -> None:
        try:
            with transaction(self.sessions) as session, deferred_batch_counts(session):
                results = [fn(session, *args) for fn, args, _ in group]
        except Exception:  # noqa: BLE001 - every call is retried alone below, with its own error
            for fn, args, future in group:
                self._run_alone(fn, args, future)
            return
        for (_, _, future), result in zip(group, results):
            future.set_result(result)

    def _run_alone(self, fn: Callable, args: tuple, future: Future) -> None:
        try:
            for attempt in Retrying(stop=stop_after_attempt(5), wait=wait_exponential(multiplier=0.05, max=2.0),
                                    retry=retry_if_exception_type(OperationalError), reraise=True):
                with attempt, transaction(self.sessions) as session, deferred_batch_counts(session):
                    result = fn(session, *args)
        except Exception as exc:  # noqa: BLE001 - handed to the awaiting caller
            future.set_exception(exc)
        else:
            future.set_result(result)
