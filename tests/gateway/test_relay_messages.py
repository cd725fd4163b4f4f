"""The relay protocol's codec: every message survives the wire as it was sent, and a frame that is not one of them
is refused with a logged error, whoever sent it, without ending the process that reads it."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import socket
import typing

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.flow.request import Ask
from gateway.relays import messages as m
from gateway.relays.channel import Channel
from gateway.relays.handshake import MAX_SEALED_FRAME, FrameSeal
from gateway.settings import load_config, with_replicas

pytestmark = pytest.mark.unit

LOADED = load_config(None)
CONFIGS = [LOADED, with_replicas(LOADED, ["http://a:8000", "http://b:8000"])]

times = st.one_of(st.floats(allow_nan=False, allow_infinity=False), st.just(math.inf), st.just(-math.inf))
texts = st.text(max_size=30)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**53, 2**53) | st.floats(allow_nan=False) | texts,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4), max_leaves=12)
asks = st.builds(Ask, request_id=texts, objective=texts, priority=st.integers(-1000, 1000), fairness_id=texts,
                 tenant=texts, arrived=times, pool=texts, expires_at=times, deadline=times,
                 prompt_tokens=st.integers(0, 2**31), max_new_tokens=st.integers(0, 2**31),
                 limit_param=st.none() | texts, sequences=st.integers(1, 16), prompt_exact=st.booleans(),
                 resumable=st.booleans(), streamed=st.booleans(), at_risk=st.booleans(),
                 prefix=st.lists(st.integers(0, 2**64 - 1), max_size=4).map(tuple),
                 prefix_share=st.floats(0, 1))
replica_views = st.builds(m.ReplicaFacts, url=texts, healthy=st.booleans(), refused=st.none() | texts,
                          model=st.none() | texts, model_root=st.none() | texts, runtime_version=st.none() | texts,
                          max_model_len=st.none() | st.integers(0, 2**31), pool=st.none() | texts,
                          listed=st.lists(st.tuples(texts, st.none() | texts), max_size=3).map(tuple))
ledgers = st.builds(m.LedgerSettings, block_tokens=st.integers(1, 1024),
                    safety_factor=st.floats(0, 10), window=st.floats(0, 3600))
configs = st.sampled_from(CONFIGS)
MESSAGES = typing.get_args(m.Message)
# The strategy of each message type: its fields drawn from the values above, by the field's name or type.
BY_FIELD = {"ask": asks, "replicas": st.lists(replica_views, max_size=3).map(tuple),
            "routing": st.lists(st.dictionaries(texts, json_values, max_size=3), max_size=3).map(tuple),
            "loaded": configs, "state": st.dictionaries(texts, json_values, max_size=4), "value": json_values,
            "args": st.lists(json_values, max_size=3).map(tuple),
            "every": st.floats(min_value=0.001, max_value=3600),
            "requests": st.lists(st.builds(m.HeldRequest, rid=st.integers(0, 2**31), ask=asks, url=st.none() | texts,
                                           traffic_class=st.none() | texts, output_tokens=st.integers(0, 2**31),
                                           streaming=st.booleans()), max_size=3).map(tuple),
            "pools": st.lists(st.builds(m.PoolConfig, name=texts, loaded=configs, ledger=ledgers),
                              max_size=2).map(tuple)}
BY_TYPE = {"int": st.integers(-2**63, 2**63 - 1), "int | None": st.none() | st.integers(0, 2**31), "str": texts,
           "bool": st.booleans(), "Number": times, "Number | None": st.none() | times, "str | None": st.none() | texts}


def _message(cls: type) -> st.SearchStrategy:
    hints = typing.get_type_hints(cls, include_extras=True)
    fields = {}
    for f in dataclasses.fields(cls):
        if f.name == "kind":
            continue
        if f.name in BY_FIELD:
            fields[f.name] = BY_FIELD[f.name]
        elif typing.get_origin(hints[f.name]) is typing.Literal:
            fields[f.name] = st.sampled_from(typing.get_args(hints[f.name]))
        else:
            fields[f.name] = BY_TYPE[f.type]
    return st.builds(cls, **fields)


@pytest.mark.parametrize("cls", MESSAGES, ids=lambda cls: cls.__name__)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_message_round_trips_through_the_codec(cls, data):
    message = data.draw(_message(cls))
    frame = m.encode(message)
    assert m.frame_length(frame[:4]) == len(frame) - 4
    assert m.decode(frame[4:]) == message


@pytest.mark.parametrize("body, says", [
    (b"\x80\x04not json", "Invalid JSON"),
    (b'[1, {"kind": "evict"}]', "evict.rid: Field required"),
    (b'[1, {"kind": "evict", "rid": "seven"}]', "evict.rid"),
    (b'[1, {"kind": "withdraw", "rid": 1, "at": NaN}]', "NaN is not a time"),
    (b'[1, {"kind": "finish", "rid": 1, "cause": "boredom"}]', "finish.cause"),
    (b'[1, {"kind": "call", "call_id": 1, "name": "exec", "args": []}]', "call.name"),
    (b'[1, {"kind": "os.system", "rid": 1}]', "does not match any of the expected tags"),
    (b'[1, {"kind": "evict", "rid": 1, "token": 0}]', f"protocol version 1; this gateway speaks {m.VERSION}"),
    (b'[2, {"kind": "heartbeat", "every": 0}]', "heartbeat.every"),
    (b'{"kind": "evict", "rid": 1}', "(frame)"),
])
def test_a_malformed_frame_is_refused_saying_what_is_wrong(body, says):
    with pytest.raises(m.Malformed) as refused:
        m.decode(body)
    assert says in str(refused.value)


def test_an_ask_whose_prefix_share_is_nan_is_refused():
    ask = Ask(request_id="r", objective="o", priority=0, fairness_id="f", tenant="t", arrived=0.0, prefix=(7,),
              prefix_share=0.5)
    frame = m.encode(m.Submit(rid=1, ask=ask))[4:]
    assert b'"prefix_share":0.5' in frame
    with pytest.raises(m.Malformed, match="NaN is not a time or a count"):
        m.decode(frame.replace(b'"prefix_share":0.5', b'"prefix_share":NaN'))


def test_an_oversized_frame_is_refused_before_it_is_read():
    with pytest.raises(m.Malformed, match="over the 16777216-byte limit"):
        m.frame_length(m.LENGTH.pack(m.MAX_FRAME + 1))


def test_a_channel_skips_a_malformed_frame_and_closes_on_an_oversized_one(caplog):
    async def main() -> list:
        ours, theirs = socket.socketpair()
        reader, writer = await asyncio.open_connection(sock=ours)
        channel = Channel(reader, writer, FrameSeal(b"k" * 32, b"j" * 32), peer="test peer")
        peer = FrameSeal(b"j" * 32, b"k" * 32)
        handled: list = []
        serving = asyncio.create_task(channel.serve(handled.append))
        theirs.sendall(peer.seal(b"garbage") + peer.seal(b'[2, {"kind": "nope"}]')
                       + peer.seal(m.dump(m.Evict(token=0, rid=7))))
        async with asyncio.timeout(30):
            while not handled:
                await asyncio.sleep(0.01)
            assert not channel.closed  # the bad frames were skipped, the good one after them read
            theirs.sendall(m.LENGTH.pack(MAX_SEALED_FRAME + 1) + b"x" * 64)
            await serving
        theirs.close()
        return handled

    with caplog.at_level("ERROR", logger="gateway.channel"):
        assert asyncio.run(main()) == [m.Evict(token=0, rid=7)]
    assert [r.getMessage() for r in caplog.records] == ["channel_frame_refused"] * 3
    refused = [r.fields for r in caplog.records]
    assert all(r["peer"] == "test peer" and r["error"] for r in refused)
    assert "closed" in refused[-1]["hint"]
