"""KV cache blocks: who holds which block, and which full blocks can be reused by prefix.

`BlockPool` owns the blocks, their reference counts and the free queue; `KVCacheManager` maps
requests to blocks. With prefix caching, a full block is registered under the chain hash of all
tokens up to its end (and, for the first block, the request's `cache_salt`); a later request whose
prompt starts with the same tokens and carries the same salt takes the same block (ref count + 1). A freed block with a hash stays in the free queue with its contents, in
LRU order, until an allocation needs the space: usage counts it as free, a hit revives it.

`OffloadTier` is a second, larger tier in host memory, as vLLM's CPU offloading connector keeps one: every
full block is copied there as it is produced (kept under its chain hash, least recently used evicted first),
so a prefix whose GPU blocks were reused by other requests can still be loaded back instead of recomputed.
Loaded blocks take fresh GPU blocks and are registered in the GPU cache like computed ones.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from model_sim.request import Request


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool):
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Front = evicted first. Holds every block with ref_cnt 0, cached or not.
        self.free_queue: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[int, KVBlock] = {}

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def num_cached_free(self) -> int:
        return sum(1 for b in self.cached.values() if b.ref_cnt == 0)

    def usage(self) -> float:
        return self.num_used / self.num_blocks if self.num_blocks else 0.0

    def take_new(self, n: int) -> list[KVBlock]:
        out = []
        for _ in range(n):
            _, block = self.free_queue.popitem(last=False)
            if block.block_hash is not None:
                # Evicting a cached block: its contents are about to be overwritten.
                if self.cached.get(block.block_hash) is block:
                    del self.cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def release(self, blocks: list[KVBlock]) -> None:
        # Tail blocks first, so the least shareable part of a prefix is evicted first.
        for block in reversed(blocks):
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block

    def register(self, block: KVBlock, block_hash: int) -> None:
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block


class OffloadTier:
    """Host-memory copies of full blocks, by chain hash, evicted least recently used first."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._hashes: OrderedDict[int, None] = OrderedDict()
        self.stored = 0  # blocks copied in since start
        self.evicted = 0  # blocks dropped to make room

    def __len__(self) -> int:
        return len(self._hashes)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._hashes

    def store(self, block_hash: int) -> None:
        if block_hash in self._hashes:
            self._hashes.move_to_end(block_hash)
            return
        self._hashes[block_hash] = None
        self.stored += 1
        if len(self._hashes) > self.num_blocks:
            self._hashes.popitem(last=False)
            self.evicted += 1

    def touch(self, hashes: list[int]) -> None:
        for h in hashes:
            if h in self._hashes:
                self._hashes.move_to_end(h)


def chain_hash(parent: int | None, tokens: list[int]) -> int:
    return hash((parent, tuple(tokens)))


def salt_seed(cache_salt: str | None) -> int | None:
    return None if cache_salt is None else hash(("cache_salt", cache_salt))


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool, offload_blocks: int = 0):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.offload = OffloadTier(offload_blocks) if offload_blocks else None
        self.req_blocks: dict[str, list[KVBlock]] = {}
        # How many of a request's blocks are already registered in the prefix cache.
        self._num_registered: dict[str, int] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _ensure_hashes(self, request: Request, num_full_blocks: int) -> list[int]:
        hashes = request.block_hashes
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            # As in vLLM, the salt enters the first block's hash only; the chain carries it to the rest.
            parent = hashes[-1] if hashes else salt_seed(request.cache_salt)
            hashes.append(chain_hash(parent, request.token_slice(i * bs, (i + 1) * bs)))
        return hashes

    def get_computed_blocks(self, request: Request) -> list[KVBlock]:
        """Longest cached prefix of the request's tokens, in whole blocks.

        At least one token is always left to compute, as in vLLM, so the hit covers at most
        num_tokens - 1 tokens.
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for h in self._ensure_hashes(request, max_blocks)[:max_blocks]:
            block = self.pool.cached.get(h)
            if block is None:
                break
            hits.append(block)
        if self.offload is not None and hits:
            self.offload.touch(request.block_hashes[:len(hits)])
        return hits

    def get_offloaded_blocks(self, request: Request, num_gpu_hits: int) -> int:
        """How many blocks after the GPU hit can be loaded from the offload tier (the prefix continues there).

        Like the GPU hit, at most num_tokens - 1 tokens are covered in all.
        """
        if self.offload is None:
            return 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._ensure_hashes(request, max_blocks)
        n = 0
        for h in hashes[num_gpu_hits:max_blocks]:
            if h not in self.offload:
                break
            n += 1
        self.offload.touch(hashes[num_gpu_hits:num_gpu_hits + n])
        return n

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: list[KVBlock] = ()) -> bool:
        """Give the request room for `num_new_tokens` more tokens; False (and no change) if full."""
        blocks = self.req_blocks.get(request.request_id)
        if blocks is None:
            blocks = self.req_blocks[request.request_id] = []
        total = request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        need = self.blocks_for_tokens(total) - len(blocks) - len(computed_blocks)
        revived = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if need > self.pool.num_free - revived:
            if not blocks:
                del self.req_blocks[request.request_id]
            return False
        if computed_blocks:
            self.pool.touch(list(computed_blocks))
            blocks.extend(computed_blocks)
        if need > 0:
            blocks.extend(self.pool.take_new(need))
        if self.enable_prefix_caching:
            self._register_full_blocks(request, blocks, total // self.block_size)
        return True

    def _register_full_blocks(self, request: Request, blocks: list[KVBlock], num_full: int) -> None:
        done = self._num_registered.get(request.request_id, 0)
        if num_full <= done:
            return
        hashes = self._ensure_hashes(request, num_full)
        for i in range(done, num_full):
            self.pool.register(blocks[i], hashes[i])
            if self.offload is not None:
                self.offload.store(hashes[i])
        self._num_registered[request.request_id] = num_full

    def free(self, request: Request) -> None:
        blocks = self.req_blocks.pop(request.request_id, None)
        self._num_registered.pop(request.request_id, None)
        if blocks:
            self.pool.release(blocks)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def num_blocks_of(self, request_id: str) -> int:
        return len(self.req_blocks.get(request_id, ()))

    def usage(self) -> float:
        return self.pool.usage()
