"""The dispatch loop stops when its task is cancelled, also when a wake-up lands in the same step as the cancel.

On Python 3.11, asyncio.wait_for returns the inner result when the inner wait finished as the outer task was
cancelled, and swallows the cancellation: a leader busy with work (woken all the time) that was asked to stop handed
its lease over and then never exited (the fleet's rolling-restart drill, bench/lib/fleet_drills.py)."""

import asyncio

from gateway.flow.interface import Outcome
from tests.gateway.test_flow_control import controller, req


def test_the_dispatch_loop_stops_when_cancelled_as_it_is_woken():
    fc, clock = controller()

    async def go() -> bool:
        # Batch past its ceiling: one waits in the queue, so the loop waits with its tick as the timeout.
        outcomes = [fc.submit(req(fc, clock, "batch")) for _ in range(4)]
        assert Outcome.QUEUED in outcomes, outcomes
        task = asyncio.create_task(fc.run())
        for _ in range(5):  # through its first cycle, into its wait
            await asyncio.sleep(0)
        fc.wake()
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=5)
        if not done:
            task.cancel()  # once more, so that the test ends either way
            await asyncio.wait([task], timeout=5)
        return bool(done)

    assert asyncio.run(go()), "the dispatch loop went on after it was cancelled"
