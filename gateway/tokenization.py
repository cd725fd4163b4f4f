"""Prompt token counts for KV admission: the model's own tokenizer through a replica's POST /tokenize.

Counts are cached by a hash of (model, prompt), so a repeated prompt costs one dictionary lookup. Token-id
prompts are counted locally, and `tokenizer: simulator` runs the simulator's tokenizer in process (no round
trip), and `tokenizer: local` a Hugging Face `tokenizer.json` (the `tokenizers` package) for completion
prompts, while chat still goes to the replica, which owns the chat template. When no replica answers
/tokenize in time (or the config says `estimate`) the count falls back to characters ÷ `charsPerToken`, and
each fallback is counted in a metric.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import functools
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Mapping

import aiohttp

from gateway.config import Admission, ConfigError
from gateway.log import log_event

logger = logging.getLogger("gateway.tokens")


@dataclass(frozen=True)
class TokenCount:
    prompt_tokens: int
    max_new_tokens: int
    exact: bool


def _chars(value: Any) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        return sum(_chars(v) for v in value)
    if isinstance(value, dict):
        return _chars(value.get("content")) + _chars(value.get("text"))
    return 0


def _token_ids(value: Any) -> int | None:
    """Token count of a prompt given as ids ([1, 2] or [[1, 2], [3]]), else None."""
    if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
        return len(value)
    if isinstance(value, list) and value and all(isinstance(v, list) and v and all(isinstance(i, int) for i in v)
                                                 for v in value):
        return sum(len(v) for v in value)
    return None


def max_new_tokens(body: Mapping[str, Any], default: int, path: str) -> int:
    if path.endswith("/embeddings"):
        return 0  # embeddings generate nothing
    value = body.get("max_completion_tokens") or body.get("max_tokens")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else default


class PromptCounter:
    def __init__(self, cfg: Admission, on_fallback=lambda: None):
        self.cfg = cfg
        self.on_fallback = on_fallback
        self.fallbacks = 0
        self._cache: OrderedDict[str, int] = OrderedDict()

    async def count(self, body: Mapping[str, Any], path: str, session: aiohttp.ClientSession | None,
                    replica_url: str | None) -> TokenCount:
        new = max_new_tokens(body, self.cfg.maxNewTokensDefault, path)
        prompt = body.get("messages") if "messages" in body else body.get("prompt", body.get("input"))
        ids = _token_ids(prompt)
        if ids is not None:
            return TokenCount(ids, new, True)
        key_doc = {"model": body.get("model"), "messages" if "messages" in body else "prompt": prompt}
        key = hashlib.sha256(json.dumps(key_doc, sort_keys=True, default=str).encode()).hexdigest()
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            return TokenCount(cached, new, True)
        counted = None
        if self.cfg.tokenizer == "simulator":
            counted = _simulator_count(prompt, "messages" in body)
        elif self.cfg.tokenizer == "local" and "messages" not in body:
            counted = _local_count(self.cfg.tokenizerFile or "", prompt)
        if counted is None and self.cfg.tokenizer in ("replica", "local") and session is not None \
                and replica_url is not None:
            counted = await self._tokenize(session, replica_url, body.get("model"), prompt, "messages" in body)
        if counted is None:
            self.fallbacks += 1
            self.on_fallback()
            return TokenCount(math.ceil(_chars(prompt) / self.cfg.charsPerToken), new, False)
        if self.cfg.tokenCacheSize:
            self._cache[key] = counted
            if len(self._cache) > self.cfg.tokenCacheSize:
                self._cache.popitem(last=False)
        return TokenCount(counted, new, True)

    async def _tokenize(self, session: aiohttp.ClientSession, url: str, model: Any, prompt: Any,
                        chat: bool) -> int | None:
        if chat:
            docs = [{"model": model, "messages": prompt}]
        elif isinstance(prompt, str):
            docs = [{"model": model, "prompt": prompt}]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            docs = [{"model": model, "prompt": p} for p in prompt]
        else:
            return None
        timeout = aiohttp.ClientTimeout(total=self.cfg.tokenizeTimeoutMs / 1000.0)
        total = 0
        try:
            for doc in docs:
                async with session.post(url + "/tokenize", json=doc, timeout=timeout) as resp:
                    if resp.status >= 300:
                        log_event(logger, logging.WARNING, "tokenize_refused", replica=url, status=resp.status)
                        return None
                    answer = await resp.json()
                total += int(answer["count"])
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError, KeyError, TypeError) as exc:
            log_event(logger, logging.WARNING, "tokenize_failed", replica=url, error=type(exc).__name__)
            return None
        return total


def _simulator_count(prompt: Any, chat: bool) -> int | None:
    """The simulator's own count (its chat template, its tokenizer); None for a prompt it would refuse."""
    from model_sim.errors import ApiError
    from model_sim.protocol import render_chat
    from model_sim.tokenizer import Tokenizer

    tokenizer = Tokenizer()
    try:
        if chat:
            return len(tokenizer.encode(render_chat(prompt)))
    except ApiError:
        return None
    if isinstance(prompt, str):
        return len(tokenizer.encode(prompt))
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return sum(len(tokenizer.encode(p)) for p in prompt)
    return None


@functools.lru_cache(maxsize=4)
def load_local_tokenizer(path: str):
    """A Hugging Face tokenizer from its tokenizer.json; ConfigError when it cannot be used."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError("admission.tokenizer `local` needs the `tokenizers` package: pip install "
                          "'holdback[local-tokenizer]'") from None
    try:
        return Tokenizer.from_file(path)
    except Exception as exc:  # the library raises its own exception types for unreadable files
        raise ConfigError(f"admission.tokenizerFile {path!r} is not a readable tokenizer.json: {exc}") from None


def _local_count(path: str, prompt: Any) -> int | None:
    tokenizer = load_local_tokenizer(path)
    if isinstance(prompt, str):
        return len(tokenizer.encode(prompt).ids)
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return sum(len(e.ids) for e in tokenizer.encode_batch(prompt))
    return None
