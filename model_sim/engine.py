"""The engine loop: schedule a step, wait out its modeled GPU time, apply it, wake the streams.

The loop is deadline based: a step ends at `step_start + step_time` whatever Python spent on
scheduling and bookkeeping inside it, so that overhead is absorbed instead of added. A busy step
starts at the previous step's deadline, not when the loop got round to it: streaming tokens to
clients runs between steps (in vLLM it runs in another process, beside the GPU), so a loop that
wakes a little late catches up on the next step instead of adding the delay to every token. It
never catches up more than CATCHUP_SECONDS; past that the simulator is overloaded and shows it.
Timer wakeups can be ~1 ms late, so the last `spin_seconds` (default 1.5 ms) of a step are
waited by yielding (`asyncio.sleep(0)`) in a loop, which keeps HTTP handlers running; 0 turns
that off and saves the CPU it costs. Every step first yields ARRIVAL_TURNS times, so requests
that arrived during the previous step join this one and, with all costs zero, other tasks are
never starved.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from dataclasses import dataclass
from typing import Callable

from model_sim.config import EngineConfig
from model_sim.generation import OutputLengthSampler
from model_sim.request import Request
from model_sim.scheduler import Scheduler, SchedulerOutput, StepOutcome
from model_sim.timing import TimingModel

SPIN_SECONDS = 0.0015
CATCHUP_SECONDS = 0.1
ARRIVAL_TURNS = 3


class RequestRejected(ValueError):
    """A request this engine can never serve; `param` names the body field to change."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass
class StepResult:
    output: SchedulerOutput
    outcome: StepOutcome
    started: float
    modeled_seconds: float
    ended: float


class RequestStream:
    """The handler's view of one request: wakes up whenever the request has news."""

    __slots__ = ("request", "_event")

    def __init__(self, request: Request, event: asyncio.Event | None = None):
        self.request = request
        self._event = event if event is not None else asyncio.Event()

    def notify(self) -> None:
        self._event.set()

    async def wait(self) -> None:
        await self._event.wait()
        self._event.clear()


class EngineCore:
    """The step loop, named after vLLM's own (v1 `EngineCore`): it owns the scheduler and runs its steps; the
    handlers add and abort requests and wait on their streams."""

    def __init__(
        self,
        config: EngineConfig,
        timing: TimingModel,
        output_lengths: OutputLengthSampler | None = None,
        seed: int = 0,
        id_prefix: str = "req",
        spin_seconds: float = SPIN_SECONDS,
    ):
        timing.validate()
        self.config = config
        self.timing = timing
        self.scheduler = Scheduler(config)
        self.output_lengths = output_lengths or OutputLengthSampler()
        self.step_listeners: list[Callable[[StepResult], None]] = []
        self._rng = random.Random(seed)
        self._streams: dict[str, RequestStream] = {}
        self._id_prefix = id_prefix
        self._next_id = 0
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._last_deadline: float | None = None
        self._spin = spin_seconds

    # -- requests -------------------------------------------------------------------------------

    def check_request(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise RequestRejected if a request of this shape can never be served.

        The context length is the protocol's to check (vLLM clamps max_tokens to it); this checks what
        only the engine knows: a request whose KV blocks exceed the whole cache could never be scheduled.
        """
        cfg = self.config
        if num_prompt_tokens < 1:
            raise RequestRejected("The decoder prompt cannot be empty", "prompt")
        needed = self.scheduler.kv.blocks_for_tokens(num_prompt_tokens + max_tokens - 1)
        if needed > cfg.num_blocks:
            fits = cfg.num_blocks * cfg.block_size - num_prompt_tokens + 1
            raise RequestRejected(
                f"This request needs {needed} KV-cache blocks ({num_prompt_tokens} prompt + {max_tokens} max_tokens "
                f"tokens at {cfg.block_size} tokens per block) but the replica has only {cfg.num_blocks} blocks, "
                f"so it could never run. Reduce max_tokens to at most {max(fits, 0)} or shorten the prompt.",
                "max_tokens",
            )

    def add_request(
        self,
        prompt_token_ids: list[int],
        max_tokens: int,
        *,
        min_tokens: int = 0,
        ignore_eos: bool = False,
        priority: int = 0,
        external_id: str | None = None,
        output_offset: int = 0,
        cache_salt: str | None = None,
        n: int = 1,
        choice_index: int = 0,
        event: asyncio.Event | None = None,
    ) -> RequestStream:
        """Queue a request. The n choices of one body are n requests sharing one `event`, so the handler
        wakes when any of them has news."""
        self.check_request(len(prompt_token_ids), max_tokens)
        self._next_id += 1
        request = Request(
            request_id=f"{self._id_prefix}-{self._next_id}",
            prompt_token_ids=prompt_token_ids,
            max_tokens=max_tokens,
            target_output_tokens=self.output_lengths.sample(max_tokens, min_tokens, ignore_eos),
            priority=priority,
            arrival_time=time.perf_counter(),
            external_id=external_id,
            output_offset=output_offset,
            cache_salt=cache_salt,
            n=n,
            choice_index=choice_index,
        )
        stream = RequestStream(request, event)
        self._streams[request.request_id] = stream
        self.scheduler.add_request(request)
        self._wakeup.set()
        return stream

    def abort_request(self, request_id: str) -> bool:
        """Abort now: the request leaves its queue and its blocks are free before this returns."""
        stream = self._streams.pop(request_id, None)
        request = self.scheduler.abort_request(request_id, time.perf_counter())
        if stream is not None:
            stream.notify()
        if request is not None:
            self._wakeup.set()
        return request is not None

    # -- the loop -------------------------------------------------------------------------------

    async def step(self) -> StepResult:
        # Let the previous step's tokens go out and requests that arrived meanwhile be parsed
        # before this step is scheduled (data received -> handler task -> add_request takes
        # a few loop turns); the deadline chain below keeps this from stretching the step.
        for _ in range(ARRIVAL_TURNS):
            await asyncio.sleep(0)
        now = time.perf_counter()
        last = self._last_deadline
        started = last if last is not None and 0.0 <= now - last <= CATCHUP_SECONDS else now
        out = self.scheduler.schedule(now)
        for request in out.failed:
            stream = self._streams.pop(request.request_id, None)
            if stream is not None:
                stream.notify()
        modeled = 0.0
        if not out.is_empty:
            modeled = self.timing.step_time(out.num_prefill_tokens, out.num_decode_seqs, self._rng,
                                            out.num_loaded_tokens, out.num_prefill_seqs)
        self._last_deadline = started + modeled if not out.is_empty else None
        await _sleep_until(started + modeled, self._spin)
        ended = time.perf_counter()
        outcome = self.scheduler.update_from_output(out, ended)
        streams = self._streams
        # First tokens are sent first: with hundreds of streams, the last handler woken writes
        # milliseconds after the step ended, and that serving delay should not land on TTFT.
        woken = [r for r in outcome.new_token if r.num_output_tokens == 1]
        woken += [r for r in outcome.new_token if r.num_output_tokens > 1]
        for request in woken:
            stream = streams.get(request.request_id)
            if stream is not None:
                stream.notify()
        for request in outcome.finished:
            streams.pop(request.request_id, None)
        result = StepResult(out, outcome, started, modeled, ended)
        for listener in self.step_listeners:
            listener(result)
        return result

    async def run(self) -> None:
        while True:
            if not self.scheduler.has_unfinished():
                self._last_deadline = None  # idle: the next step starts when work arrives
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            result = await self.step()
            if result.output.is_empty:
                # Nothing could be scheduled: wait for an arrival, an abort or a finish.
                self._wakeup.clear()
                try:
                    await asyncio.wait_for(self._wakeup.wait(), timeout=0.05)
                except asyncio.TimeoutError:
                    continue

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run(), name="model_sim-engine")

    async def stop(self) -> None:
        for request_id in list(self._streams):
            self.abort_request(request_id)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


async def _sleep_until(deadline: float, spin: float) -> None:
    remaining = deadline - time.perf_counter()
    if remaining > spin:
        await asyncio.sleep(remaining - spin)
    await asyncio.sleep(0)
    while time.perf_counter() < deadline:
        await asyncio.sleep(0)
