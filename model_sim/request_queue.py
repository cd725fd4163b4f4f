"""The waiting queue, one class per scheduling policy.

fcfs: arrival order; a preempted request goes back to the front.
priority: a heap on (priority, arrival_time): a LOWER priority value is admitted first, as in vLLM;
a preempted request keeps its arrival time and so sorts ahead of later arrivals of its priority.
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections import deque
from typing import Iterator, Protocol

from model_sim.request import Request


class SchedulingPolicy(str, enum.Enum):
    FCFS = "fcfs"
    PRIORITY = "priority"


class WaitingQueue(Protocol):
    def add(self, request: Request) -> None: ...
    def prepend(self, request: Request) -> None: ...
    def peek(self) -> Request: ...
    def pop(self) -> Request: ...
    def remove(self, request: Request) -> bool: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...


class FcfsQueue:
    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._q.append(request)

    def prepend(self, request: Request) -> None:
        self._q.appendleft(request)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, request: Request) -> bool:
        try:
            self._q.remove(request)
            return True
        except ValueError:
            return False

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = itertools.count()

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time, next(self._seq), request))

    # Order comes from (priority, arrival): a preempted request needs no special place.
    prepend = add

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> bool:
        for i, entry in enumerate(self._heap):
            if entry[3] is request:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return True
        return False

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap, key=lambda e: e[:3]))


def make_queue(policy: SchedulingPolicy) -> WaitingQueue:
    return PriorityQueue() if SchedulingPolicy(policy) is SchedulingPolicy.PRIORITY else FcfsQueue()
