"""The channel between flow control and relays on their own: the handshake, the MAC on every frame, the
heartbeat, the secret, and the `holdback gateway --role` flags that do not go together."""

from __future__ import annotations

import asyncio
import socket

import pytest

from gateway.cli import main
from gateway.relays import messages as m
from gateway.relays.channel import Channel
from gateway.relays.handshake import (SECRET_ENV, FrameSeal, PeerRefused, SecretError, Session, channel_secret,
                                      handshake)

pytestmark = pytest.mark.unit

SECRET = b"s" * 32


async def _pair(relay_secret: bytes = SECRET, flow_secret: bytes = SECRET, heartbeat: float = 1.0):
    """Both ends' handshakes over a socket pair: (relay's session or error, flow control's), and the streams."""
    a, b = socket.socketpair()
    relay_io = await asyncio.open_connection(sock=a)
    flow_io = await asyncio.open_connection(sock=b)
    sessions = await asyncio.gather(handshake(*relay_io, relay_secret, "relay", heartbeat),
                                    handshake(*flow_io, flow_secret, "flow-control", heartbeat),
                                    return_exceptions=True)
    return sessions, relay_io, flow_io


def test_both_ends_pass_the_handshake_and_open_each_others_frames():
    async def run():
        (relay, flow), _, _ = await _pair(heartbeat=0.5)
        assert isinstance(relay, Session) and isinstance(flow, Session)
        assert relay.peer_heartbeat == flow.peer_heartbeat == 0.5
        for n in range(3):
            body = m.dump(m.Evict(token=n, rid=n))
            frame = relay.seal.seal(body)
            assert flow.seal.open(frame[m.LENGTH.size:]) == body
        back = flow.seal.seal(b"x")
        assert relay.seal.open(back[m.LENGTH.size:]) == b"x"

    asyncio.run(run())


def test_a_peer_with_another_secret_fails_the_handshake_on_both_ends():
    async def run():
        (relay, flow), _, _ = await _pair(relay_secret=b"t" * 32)
        for refused in (relay, flow):
            assert isinstance(refused, PeerRefused)
            assert "does not hold this channel's secret" in refused.reason

    asyncio.run(run())


def test_a_peer_greeting_in_the_wrong_role_or_version_is_refused():
    async def run():
        a, b = socket.socketpair()
        left, right = await asyncio.open_connection(sock=a), await asyncio.open_connection(sock=b)
        both = await asyncio.gather(handshake(*left, SECRET, "relay", 1.0), handshake(*right, SECRET, "relay", 1.0),
                                    return_exceptions=True)
        assert all("it greeted as 'relay'" in str(e) for e in both)
        a, b = socket.socketpair()
        reader, writer = await asyncio.open_connection(sock=a)
        old = b'[1, {"kind": "hello", "pid": 1, "index": 0}]'  # a relay of version 1 says hello at once
        b.sendall(m.LENGTH.pack(len(old)) + old)
        with pytest.raises(PeerRefused, match=f"protocol version 1, this end {m.VERSION}"):
            await handshake(reader, writer, SECRET, "flow-control", 1.0)

    asyncio.run(run())


def test_a_peer_that_never_greets_is_refused_after_the_handshake_timeout():
    async def run():
        a, _b = socket.socketpair()
        reader, writer = await asyncio.open_connection(sock=a)
        with pytest.raises(PeerRefused, match="no handshake within 0.2s"):
            await handshake(reader, writer, SECRET, "flow-control", 1.0, timeout=0.2)

    asyncio.run(run())


def test_a_replayed_reordered_or_altered_frame_fails_its_mac():
    sender, receiver = FrameSeal(b"k" * 32, b"j" * 32), FrameSeal(b"j" * 32, b"k" * 32)
    first, second, third = (sender.seal(body)[m.LENGTH.size:] for body in (b"one", b"two", b"three"))
    assert receiver.open(first) == b"one"
    with pytest.raises(PeerRefused, match="frame 1 from it fails its MAC"):
        receiver.open(first)  # replayed
    with pytest.raises(PeerRefused):
        receiver.open(third)  # reordered: the second is due
    with pytest.raises(PeerRefused):
        receiver.open(second[:-1] + b"X")  # altered
    assert receiver.open(second) == b"two" and receiver.open(third) == b"three"
    with pytest.raises(PeerRefused):
        FrameSeal(b"k" * 32, b"other key" * 4).open(first)  # sealed with another key
    with pytest.raises(PeerRefused):
        receiver.open(b"short")


def _channel_pair(tcp: bool = False):
    if tcp:  # a connected pair over loopback TCP, where silence is judged
        with socket.create_server(("127.0.0.1", 0)) as server:
            theirs = socket.create_connection(server.getsockname())
            ours, _ = server.accept()
    else:
        ours, theirs = socket.socketpair()
    return ours, theirs, FrameSeal(b"k" * 32, b"j" * 32), FrameSeal(b"j" * 32, b"k" * 32)


def test_a_channel_closes_on_a_frame_that_fails_its_mac_saying_why(caplog):
    async def run() -> Channel:
        ours, theirs, seal, peer = _channel_pair()
        channel = Channel(*await asyncio.open_connection(sock=ours), seal, peer="test peer")
        serving = asyncio.create_task(channel.serve(lambda message: None))
        good = peer.seal(m.dump(m.Evict(token=1, rid=1)))
        theirs.sendall(good + good)  # the second one is a replay
        async with asyncio.timeout(30):
            await serving
        return channel

    with caplog.at_level("ERROR", logger="gateway.channel"):
        channel = asyncio.run(run())
    assert channel.closed and "frame 1 from it fails its MAC" in channel.reason
    [refused] = [r for r in caplog.records if r.getMessage() == "channel_peer_refused"]
    assert refused.fields["peer"] == "test peer" and "fails its MAC" in refused.fields["reason"]


def test_a_channel_beats_and_closes_when_its_peer_is_silent_for_three_heartbeats(caplog):
    async def run() -> tuple[Channel, float, bytes]:
        ours, theirs, seal, peer = _channel_pair(tcp=True)
        # Timed from before the channel exists: it counts silence from its making, and awaiting the other end's
        # connection can take a while on a loaded machine.
        started = asyncio.get_running_loop().time()
        channel = Channel(*await asyncio.open_connection(sock=ours), seal, peer="silent peer", heartbeat=0.05,
                          peer_heartbeat=0.1)
        reader, _writer = await asyncio.open_connection(sock=theirs)
        async with asyncio.timeout(30):
            await channel.serve(lambda message: None)
            beats = await reader.read()
        return channel, asyncio.get_running_loop().time() - started, beats

    with caplog.at_level("ERROR", logger="gateway.channel"):
        channel, took, beats = asyncio.run(run())
    assert took >= 0.3  # three of the peer's 0.1s heartbeats, never sooner
    assert "3 of its heartbeats of 0.1s" in channel.reason
    assert [r.getMessage() for r in caplog.records] == ["channel_peer_silent"]
    # It sent its own heartbeats meanwhile, each a sealed ChannelHeartbeat.
    opener = FrameSeal(b"j" * 32, b"k" * 32)
    first = opener.open(beats[m.LENGTH.size:m.LENGTH.size + m.frame_length(beats[:m.LENGTH.size])])
    assert m.decode(first) == m.ChannelHeartbeat(every=0.05)


def test_the_secret_comes_from_a_file_or_the_variable_and_must_be_long_enough(tmp_path):
    good = tmp_path / "secret"
    good.write_text("a" * 40 + "\n")
    assert channel_secret(str(good), {}) == b"a" * 40
    assert channel_secret(None, {SECRET_ENV: "b" * 32}) == b"b" * 32
    with pytest.raises(SecretError, match="is 31 bytes; it must be at least 32"):
        channel_secret(None, {SECRET_ENV: "c" * 31})
    with pytest.raises(SecretError, match="set one"):
        channel_secret(str(good), {SECRET_ENV: "b" * 32})
    with pytest.raises(SecretError, match="--channel-secret-file or|--channel-secret-file, or"):
        channel_secret(None, {})
    with pytest.raises(SecretError, match="cannot read --channel-secret-file"):
        channel_secret(str(tmp_path / "missing"), {})


@pytest.mark.parametrize("argv, says", [
    (["--role", "relay"], "--role relay needs --flow-control"),
    (["--role", "relay", "--flow-control", "127.0.0.1:1", "--relays-listen", "127.0.0.1:2"],
     "--relays-listen is flow control's"),
    (["--role", "relay", "--flow-control", "nowhere"], "--flow-control: 'nowhere' is not HOST:PORT"),
    (["--role", "relay", "--flow-control", "127.0.0.1:1", "--config", "x.yaml"],
     "--config: a relay takes its config from flow control"),
    (["--role", "relay", "--flow-control", "127.0.0.1:1", "--workers", "2"], "--workers is for the whole gateway"),
    (["--role", "relay", "--flow-control", "127.0.0.1:1", "--lease-redis", "redis://x"],
     "--lease-redis is flow control's"),
    (["--lease-redis", "redis://127.0.0.1:6379/0"], "--lease-redis goes with --role flow-control"),
    (["--role", "flow-control", "--relays-listen", "127.0.0.1:1", "--lease-redis", "redis://x", "--lease-seconds",
      "0"], "--lease-seconds must be over 0.3"),
    (["--role", "flow-control"], "--role flow-control needs --relays-listen"),
    (["--role", "flow-control", "--relays-listen", "127.0.0.1:1", "--port", "8200"],
     "--role flow-control serves no clients"),
    (["--role", "flow-control", "--relays-listen", "127.0.0.1:1", "--flow-control", "127.0.0.1:2"],
     "--flow-control is a relay's"),
    (["--relays-listen", "127.0.0.1:1"], "--relays-listen goes with --role flow-control"),
    (["--flow-control", "127.0.0.1:1"], "--flow-control goes with --role relay"),
    (["--role", "relay", "--flow-control", "127.0.0.1:1"], "need the channel's shared secret"),
    (["--role", "flow-control", "--relays-listen", "127.0.0.1:1", "--channel-secret-file", "SHORT"],
     "is 9 bytes; it must be at least 32"),
])
def test_role_flags_that_do_not_go_together_exit_2_saying_what_to_change(argv, says, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    short = tmp_path / "short"
    short.write_text("too short")
    argv = [str(short) if a == "SHORT" else a for a in argv]
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert says in capsys.readouterr().err


def test_on_one_host_a_silent_peer_is_not_cut_off_only_a_closed_one():
    """A Unix socket (`--workers N`): a relay starved of CPU is still there; one that died closes its end."""
    async def run() -> tuple[bool, bool]:
        ours, theirs, seal, _ = _channel_pair()
        channel = Channel(*await asyncio.open_connection(sock=ours), seal, peer="starved relay", heartbeat=0.02,
                          peer_heartbeat=0.02)
        serving = asyncio.create_task(channel.serve(lambda message: None))
        await asyncio.sleep(0.5)  # 25 of the peer's heartbeats without a word from it
        open_while_silent = not channel.closed
        theirs.close()
        async with asyncio.timeout(30):
            await serving
        return open_while_silent, channel.closed

    assert asyncio.run(run()) == (True, True)
