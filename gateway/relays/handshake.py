"""How a relay and flow control prove to each other that they hold the channel's secret, and the seal on every
frame after that (the same on a Unix socket and over TCP).

Each end sends a `Greet` (its role, a fresh random nonce, its heartbeat) as a plain frame, then derives one key per
direction from the secret and both greetings, exactly as sent (a greeting changed on the way yields other keys), and
sends a `Proof`: the MAC of a fixed word under its sending key. An end whose proof does not verify does not hold the
secret, and is refused. After that, each frame is `length | MAC | body`, the MAC being HMAC-SHA256 under the
direction's key over the frame's sequence number in that direction and its body: a frame altered, replayed,
reordered or dropped within the connection fails the next check. Keys are new on every connection (new nonces), so a
frame from another connection fails too. The frames are authenticated, not encrypted.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import os
import secrets
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal, Mapping, Union

from pydantic import Field, StringConstraints, TypeAdapter, ValidationError

from gateway.relays.messages import LENGTH, MAX_FRAME, VERSION

# The secret's variable (its text's bytes are the secret); `--channel-secret-file` names a file instead.
SECRET_ENV = "HOLDBACK_GATEWAY_CHANNEL_SECRET"
MIN_SECRET_BYTES = 32
MAC_BYTES = hashlib.sha256().digest_size
# A greeting or a proof is well under this: a longer frame before the proof is refused unread.
MAX_HANDSHAKE_FRAME = 1024
HANDSHAKE_SECONDS = 10.0
_SEQUENCE = struct.Struct(">Q")
_PROOF_WORD = b"holdback channel proof"
Role = Literal["relay", "flow-control"]
Hex = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
_FROZEN = dict(frozen=True, slots=True, kw_only=True)


class SecretError(ValueError):
    """No usable channel secret: the message says what to set."""


class PeerRefused(ConnectionError):
    """The peer failed the handshake or sent a frame whose MAC does not verify: `reason` says which."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class Standby(PeerRefused):
    """The flow control greeted as a standby: another process holds the lease (gateway/relays/leadership.py)."""


def channel_secret(path: str | None, environ: Mapping[str, str] | None = None) -> bytes:
    """The shared secret from the file at `path`, else from $HOLDBACK_GATEWAY_CHANNEL_SECRET (surrounding
    whitespace, a file's last newline included, is not part of it)."""
    environ = os.environ if environ is None else environ
    if path is not None and environ.get(SECRET_ENV):
        raise SecretError(f"both --channel-secret-file and ${SECRET_ENV} are set: set one")
    if path is not None:
        try:
            secret, where = Path(path).read_bytes().strip(), f"--channel-secret-file {path}"
        except OSError as exc:
            raise SecretError(f"cannot read --channel-secret-file {path}: {exc.strerror or exc}") from None
    elif environ.get(SECRET_ENV):
        secret, where = environ[SECRET_ENV].strip().encode(), f"${SECRET_ENV}"
    else:
        raise SecretError(f"a relay and flow control on their own need the channel's shared secret: put at least "
                          f"{MIN_SECRET_BYTES} random bytes in a file named by --channel-secret-file, or in "
                          f"${SECRET_ENV} (e.g. `python -c 'import secrets; print(secrets.token_hex(32))'`), the "
                          f"same on every relay and flow control")
    if len(secret) < MIN_SECRET_BYTES:
        raise SecretError(f"the channel secret from {where} is {len(secret)} bytes; it must be at least "
                          f"{MIN_SECRET_BYTES} (e.g. `python -c 'import secrets; print(secrets.token_hex(32))'`)")
    return secret


def run_secret() -> bytes:
    """A secret for one run of `--workers N`, handed to its relays in their environment."""
    return secrets.token_hex(MIN_SECRET_BYTES).encode()


@dataclass(**_FROZEN)
class Greet:
    kind: Literal["greet"] = "greet"
    role: Role
    nonce: Hex
    heartbeat: Annotated[float, Field(gt=0, allow_inf_nan=False)]
    # A flow control that does not lead says so: a relay then tries its next address.
    standby: bool = False


@dataclass(**_FROZEN)
class Proof:
    kind: Literal["proof"] = "proof"
    mac: Hex


_HANDSHAKE = TypeAdapter(tuple[int, Annotated[Union[Greet, Proof], Field(discriminator="kind")]])


def handshake_frame(message: Greet | Proof) -> bytes:
    body = _HANDSHAKE.dump_json((VERSION, message))
    return LENGTH.pack(len(body)) + body


def read_handshake(body: bytes) -> Greet | Proof:
    with contextlib.suppress(ValueError, TypeError, KeyError, IndexError):
        version = json.loads(body)[0]  # an older end says so before anything else
        if isinstance(version, int) and version != VERSION:
            raise PeerRefused(f"it speaks protocol version {version}, this end {VERSION}: run one version of "
                              f"holdback on both ends")
    try:
        version, message = _HANDSHAKE.validate_json(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"][1:]) or "(frame)"
        raise PeerRefused(f"its handshake frame is not one: {where}: {first['msg']}") from None
    return message


class FrameSeal:
    """The MACs of one connection: `seal` a body to send, `open` a received frame's payload (MAC then body)."""

    def __init__(self, send_key: bytes, receive_key: bytes):
        self._send_key, self._receive_key = send_key, receive_key
        self.sent = 0
        self.received = 0

    def seal(self, body: bytes) -> bytes:
        mac = hmac.digest(self._send_key, _SEQUENCE.pack(self.sent) + body, "sha256")
        self.sent += 1
        return LENGTH.pack(MAC_BYTES + len(body)) + mac + body

    def open(self, payload: bytes) -> bytes:
        """The body of the next frame received; `PeerRefused` when its MAC does not verify."""
        mac, body = payload[:MAC_BYTES], payload[MAC_BYTES:]
        expected = hmac.digest(self._receive_key, _SEQUENCE.pack(self.received) + body, "sha256")
        if len(payload) < MAC_BYTES or not hmac.compare_digest(mac, expected):
            raise PeerRefused(f"frame {self.received} from it fails its MAC: altered, replayed or reordered, or "
                              f"sealed with another secret")
        self.received += 1
        return body


def session_keys(secret: bytes, relay_greet: bytes, flow_greet: bytes) -> dict[Role, bytes]:
    """The key of what each role sends, from the secret and both greetings as sent."""
    transcript = hashlib.sha256(relay_greet).digest() + hashlib.sha256(flow_greet).digest()
    return {role: hmac.digest(secret, b"holdback channel key|" + role.encode() + b"|" + transcript, "sha256")
            for role in ("relay", "flow-control")}


@dataclass(**_FROZEN)
class Session:
    """A handshake passed: the seal for the connection's frames and the peer's heartbeat."""
    seal: FrameSeal
    peer_heartbeat: float


async def _read_frame(reader: asyncio.StreamReader, limit: int) -> bytes:
    try:
        (size,) = LENGTH.unpack(await reader.readexactly(LENGTH.size))
        if size > limit:
            raise PeerRefused(f"it announced a {size}-byte frame in the handshake (at most {limit})")
        return await reader.readexactly(size)
    except (asyncio.IncompleteReadError, ConnectionError) as exc:
        if isinstance(exc, PeerRefused):
            raise
        raise PeerRefused("it closed the connection during the handshake (does it hold the same secret, and run "
                          "the same version?)") from None


async def handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, secret: bytes, role: Role,
                    heartbeat: float, timeout: float = HANDSHAKE_SECONDS, standby: bool = False) -> Session:
    """Greet, prove and check the peer's proof; `PeerRefused` with the reason when it fails or takes too long, and
    (a relay's end) `Standby` when the flow control proved itself but does not lead."""
    peer_role: Role = "flow-control" if role == "relay" else "relay"
    mine = handshake_frame(Greet(role=role, nonce=secrets.token_hex(32), heartbeat=heartbeat, standby=standby))
    try:
        async with asyncio.timeout(timeout):
            writer.write(mine)
            theirs = await _read_frame(reader, MAX_HANDSHAKE_FRAME)
            greet = read_handshake(theirs)
            if not isinstance(greet, Greet):
                raise PeerRefused("it sent its proof before greeting")
            if greet.role != peer_role:
                raise PeerRefused(f"it greeted as {greet.role!r}; this end, {role!r}, talks to {peer_role!r} only")
            mine_body = mine[LENGTH.size:]
            keys = (session_keys(secret, mine_body, theirs) if role == "relay"
                    else session_keys(secret, theirs, mine_body))
            send_key, receive_key = keys[role], keys[peer_role]
            writer.write(handshake_frame(Proof(mac=hmac.digest(send_key, _PROOF_WORD, "sha256").hex())))
            proof = read_handshake(await _read_frame(reader, MAX_HANDSHAKE_FRAME))
            if not isinstance(proof, Proof):
                raise PeerRefused("it greeted twice")
            expected = hmac.digest(receive_key, _PROOF_WORD, "sha256").hex()
            if not hmac.compare_digest(proof.mac, expected):
                raise PeerRefused("its proof does not verify: it does not hold this channel's secret")
            if greet.standby and role == "relay":  # said in a greeting its proof vouches for
                raise Standby("it is a standby flow control, not the leader: another process holds the lease")
    except TimeoutError:
        raise PeerRefused(f"no handshake within {timeout:g}s") from None
    return Session(seal=FrameSeal(send_key, receive_key), peer_heartbeat=greet.heartbeat)


# A sealed frame may carry the largest message and its MAC.
MAX_SEALED_FRAME = MAX_FRAME + MAC_BYTES
