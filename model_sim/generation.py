"""What the simulated model "generates": how many tokens, and which ones.

Token text is a fixed word list indexed by output position, so every run and every replica
produces the same text and a test can predict it. The model continues its own text: a prompt that
already ends with the first k output words (a resumed request) generates from position k on, so a
continued request ends with the text an uninterrupted run would have produced. The length is `max_tokens` unless the replica
runs in `random` output-length mode and the request does not set `ignore_eos`.
"""

from __future__ import annotations

import enum
import random

from holdback.sim_tokenizer import piece_to_id

# Short words so that " word" is one token of the simulator's tokenizer.
WORDS = (
    "the of and to in is it for on was as at by an be or are we but not you all can her one has our "
    "out day get new now old see two way who boy did its let put say she too use sun sky sea red "
    "blue green light stone river cloud quiet north south east west early late"
).split()
OUTPUT_TOKEN_IDS = tuple(piece_to_id(f" {w}".encode()) for w in WORDS)
OUTPUT_TOKEN_TEXT = tuple(f" {w}" for w in WORDS)


def output_token_id(position: int) -> int:
    return OUTPUT_TOKEN_IDS[position % len(OUTPUT_TOKEN_IDS)]


def output_token_text(position: int) -> str:
    return OUTPUT_TOKEN_TEXT[position % len(OUTPUT_TOKEN_TEXT)]


def output_text(start: int, end: int) -> str:
    return "".join(output_token_text(i) for i in range(start, end))


_WORD_POSITION = {w: i for i, w in enumerate(WORDS)}


def continuation_offset(text: str) -> int:
    """How many output words `text` already ends with: the k of the longest `output_text(0, k)` suffix.

    Read from the end, word by word, while the words follow the output sequence backwards; the
    answer is the longest run that starts at output position 0.
    """
    end = len(text)
    last = None  # position of the final word in the cycle
    run = 0
    while end > 0:
        space = text.rfind(" ", 0, end)
        if space < 0:
            break
        position = _WORD_POSITION.get(text[space + 1:end])
        if position is None:
            break
        if last is None:
            last = position
        elif position != (last - run) % len(WORDS):
            break
        run += 1
        end = space
    if last is None:
        return 0
    # k output words end at position k - 1 ≡ last (mod len(WORDS)); take the longest k within the run.
    k = last + 1
    if k > run:
        return 0
    return k + (run - k) // len(WORDS) * len(WORDS)


class OutputLengthMode(str, enum.Enum):
    FIXED = "fixed"
    RANDOM = "random"


class OutputLengthSampler:
    """Decides a request's output length when it arrives.

    fixed: always max_tokens (finish_reason "length").
    random: uniform in [max(1, min_tokens), max_tokens] from a seeded generator (finish_reason
    "stop" when it ends early); `ignore_eos` still forces max_tokens.
    """

    def __init__(self, mode: OutputLengthMode = OutputLengthMode.FIXED, seed: int = 0):
        self.mode = OutputLengthMode(mode)
        self._rng = random.Random(seed)

    def sample(self, max_tokens: int, min_tokens: int = 0, ignore_eos: bool = False) -> int:
        if ignore_eos or self.mode is OutputLengthMode.FIXED:
            return max_tokens
        low = min(max(1, min_tokens), max_tokens)
        return self._rng.randint(low, max_tokens)
