"""How a replica's engine slots are learned from its scraped metrics when the config does not give them
(`engine.maxNumSeqs`), and what flow control tells it so that it can tell a request waiting for a slot from one
waiting for KV. `Replica` (gateway/replicas.py) carries the fields; this is the reasoning over them.
"""

from __future__ import annotations

import logging

from gateway.log import log_event

logger = logging.getLogger("gateway.replicas")

# Learning a replica's slots (Replica.see_slots): requests waiting for no KV (the prompts flow control sent there
# fit its free blocks; untold, its KV at most this full) and the same number running, at every scrape for this long.
LEARN_KV_BELOW = 0.5
LEARN_SECONDS = 2.0


class SlotLearning:
    """The slot-learning part of a `Replica`: its fields are the replica's own (learned_slots, slots_seen,
    slots_dipped, peak_running, awaited, awaited_seen, running, waiting, kv_usage, kv_usage_max, num_gpu_blocks,
    kv_block_size, engine)."""

    def see_slots(self, now: float) -> bool:
        """Learn its engine's slots from the metrics just scraped at `now` (monotonic); True when they changed.

        vLLM runs at most --max-num-seqs requests and queues the rest, but it also queues a request its KV cannot
        hold or its step's token budget has no room for, and a replica whose metrics are read between steps
        (the simulator) shows the requests that arrived during a step as waiting. Only a slot limit pins the
        running count while requests wait: so the slots are learned from scrapes in a row, spanning LEARN_SECONDS, at
        which no request waited for KV (`waits_for_no_kv`) and the same number ran, the most this replica has run
        since it came up, with requests waiting at the first and the last of them. A scrape in between at which none
        waited is neither, whatever ran (nothing waiting says nothing of slots), and so is one that shows fewer
        running while requests wait unless the next does too (vLLM's numbers may be read between a step's finishes and
        the next step's refill). Any other scrape starts again; an engine with free slots runs a request that waited
        at its next step, so a running count pinned with requests waiting is not seen for long unless slots pin it.
        vLLM never runs more than its slots, so a running count above the learned slots raises them. Learned slots are
        forgotten when the replica goes down (it may come back with other flags)."""
        running = int(self.running) if self.running is not None else 0
        self.peak_running = max(self.peak_running, running)
        if self.learned_slots is not None:
            if running <= self.learned_slots:
                return False
            self.learned_slots = running
        else:
            kv = self.kv_usage_max if self.kv_usage_max is not None else self.kv_usage
            kv_free = self.waits_for_no_kv(kv, running)
            if (self.waiting or 0) < 1:
                # Nothing waits: no sign of a slot limit or of its absence. Ten requests on eight slots leave
                # none waiting whenever two end close together, and a fast engine runs nothing at all for a moment
                # while the next requests are still on their way to it. It neither starts a run nor ends one.
                return False
            pinned = kv_free and running >= 1 and running == self.peak_running
            if not pinned and kv_free and self.slots_seen is not None and not self.slots_dipped:
                # Fewer run while requests wait, once: vLLM's numbers are taken after a step's finished requests
                # left and before the next step gives their slots to the waiting ones, so a scrape may land there.
                # Two such scrapes in a row are no longer one step's moment.
                self.slots_dipped = True
                return False
            self.slots_dipped = False
            if not pinned:
                if self.slots_seen is not None:
                    log_event(logger, "replica_slots_run_broken", level=logging.DEBUG, replica=self.url,
                              running=running, peak_running=self.peak_running, waiting=self.waiting, kv_usage=kv,
                              run_seconds=round(now - self.slots_seen[0], 3))
                self.slots_seen = None
                return False
            if self.slots_seen is None or self.slots_seen[1] != running:
                log_event(logger, "replica_slots_run_started", level=logging.DEBUG, replica=self.url,
                          running=running, waiting=self.waiting, kv_usage=kv)
                self.slots_seen = (now, running)
            if now - self.slots_seen[0] < LEARN_SECONDS:
                return False
            self.learned_slots = running
        if self.engine is not None:
            self.take_engine(self.engine)
        return True

    def waits_for_no_kv(self, kv: float | None, running: int) -> bool:
        """Whether the requests the last scrape shows waiting (`kv`: its fullest engine's KV usage) wait for no KV.

        vLLM admits the head of its waiting queue at a step once its free blocks hold the whole uncached prompt
        (vLLM 0.34, vllm/v1/core/sched/scheduler.py, `Scheduler.schedule`: the waiting loop stops at the head when
        `KVCacheManager.allocate_slots` in vllm/v1/core/kv_cache_manager.py finds fewer free blocks than the full
        sequence needs, `scheduler_reserve_full_isl` being on by default and the `--watermark` 0), after the running
        requests took the block their next token may need (the running loop goes first). So when no more wait than
        the requests sent here that have not answered, and the free blocks hold the largest of their prompts, one
        block more and a block per running request, none waits for KV. Otherwise (prompts not told, requests of
        others or preempted ones waiting, the pool not known yet) only a KV at most half used says so."""
        count, largest = self.awaited_seen
        if (kv is not None and self.num_gpu_blocks and self.kv_block_size and largest
                and (self.waiting or 0) <= count):
            free = (1.0 - kv) * (self.num_gpu_blocks - 1)  # vLLM's usage leaves its null block out
            return free >= -(-largest // self.kv_block_size) + 1 + running
        return kv is not None and kv <= LEARN_KV_BELOW

    def sent(self, prompt_tokens: int) -> None:
        """Flow control sent it a request of `prompt_tokens` (0: not counted exactly) that has not answered yet."""
        self.awaited[prompt_tokens] += 1
        count, largest = self.awaited_seen
        exact = prompt_tokens > 0 and largest is not None
        self.awaited_seen = (max(count, self.awaited.total()), max(largest, prompt_tokens) if exact else None)

    def scrape_began(self) -> None:
        self.awaited_seen = (self.awaited.total(), None if 0 in self.awaited else max(self.awaited, default=0))

    def answered(self, prompt_tokens: int) -> None:
        """A request `sent` here answered (its first byte went out), ended or moved to another replica."""
        self.awaited[prompt_tokens] -= 1
        if self.awaited[prompt_tokens] <= 0:
            del self.awaited[prompt_tokens]

    @property
    def slots_learned(self) -> bool:
        """Whether its slots and capacity are the learned ones (maxNumSeqs unset, learning on, slots learned)."""
        return (self.learned_slots is not None and self.engine is not None and self.engine.maxNumSeqs is None
                and self.engine.learnMaxNumSeqs)

    def forget_slots(self) -> None:
        self.learned_slots = None
        self.slots_seen = None
        self.slots_dipped = False
        self.peak_running = 0
        if self.engine is not None:
            self.take_engine(self.engine)
