"""The simulator's tokenizer: deterministic, reversible, and the same everywhere it is used.

Text is split as GPT-2-style tokenizers do: words and punctuation marks with at most one leading space,
and whitespace runs (a run before a word leaves its last space to the word, so a newline never merges with
the word after it: text continued after a chat header tokenizes as the model generated it). Any piece
longer than 6 UTF-8 bytes is cut into 6-byte pieces. A token id packs the piece's bytes
and its length into one integer below 2**53, so `decode(encode(text)) == text` and ids survive JSON
in any language. English prose comes out at roughly one token per short word, two per long word.
"""

from __future__ import annotations

import re

MAX_PIECE_BYTES = 6
_PIECES = re.compile(r" ?\w+| ?[^\w\s]|\s+(?!\S)|\s+")


def _split_bytes(piece: bytes) -> list[bytes]:
    if len(piece) <= MAX_PIECE_BYTES:
        return [piece]
    out: list[bytes] = []
    start = 0
    while start < len(piece):
        end = min(start + MAX_PIECE_BYTES, len(piece))
        # never cut a multi-byte character: back off while the next byte is a continuation byte
        while end < len(piece) and end > start + 1 and (piece[end] & 0xC0) == 0x80:
            end -= 1
        out.append(piece[start:end])
        start = end
    return out


def piece_to_id(piece: bytes) -> int:
    return (int.from_bytes(piece, "big") << 3) | (len(piece) - 1)


def id_to_piece(token_id: int) -> bytes:
    length = (token_id & 0b111) + 1
    value = token_id >> 3
    if token_id < 0 or length > MAX_PIECE_BYTES or value >= 1 << (8 * length):
        return f"<|{token_id}|>".encode()
    return value.to_bytes(length, "big")


class Tokenizer:
    """`encode` for prompt counts, /tokenize and prefix hashing; `decode` for /detokenize."""

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for match in _PIECES.finditer(text):
            for piece in _split_bytes(match.group().encode("utf-8")):
                ids.append(piece_to_id(piece))
        return ids

    def count(self, text: str) -> int:
        """len(encode(text)) without building the ids: a piece of at most 6 characters that are all ASCII is
        one token; only longer or non-ASCII pieces are cut as encode cuts them."""
        pieces = _PIECES.findall(text)
        n = len(pieces)
        if text.isascii():  # one byte per character: a piece of L > 6 is cut into ceil(L / 6)
            return n + sum((len(p) - 1) // MAX_PIECE_BYTES for p in pieces if len(p) > MAX_PIECE_BYTES)
        for piece in pieces:
            if len(piece) > MAX_PIECE_BYTES or not piece.isascii():
                data = piece.encode("utf-8")
                if len(data) > MAX_PIECE_BYTES:
                    n += len(_split_bytes(data)) - 1
        return n

    def decode(self, token_ids: list[int]) -> str:
        return b"".join(id_to_piece(t) for t in token_ids).decode("utf-8", errors="replace")

    def token_strings(self, token_ids: list[int]) -> list[str]:
        return [id_to_piece(t).decode("utf-8", errors="replace") for t in token_ids]
