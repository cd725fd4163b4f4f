"""Endpoint picking: filter down or full replicas, prefer low in-flight and low KV usage."""

from gateway.policies.picker import EndpointPicker
from gateway.policies.saturation import ConcurrencyDetector
from gateway.replicas import Replica


def test_picks_least_loaded_healthy_replica_with_room():
    d = ConcurrencyDetector(max_concurrency=4)
    p = EndpointPicker(max_concurrency=4)
    down = Replica("http://down", healthy=False, in_flight=0)
    full = Replica("http://full", healthy=True, in_flight=4)
    busy = Replica("http://busy", healthy=True, in_flight=2)
    idle = Replica("http://idle", healthy=True, in_flight=1)
    for _ in range(5):
        assert p.pick([down, full, busy, idle], d, 0) is idle
    assert p.pick([down, full], d, 0) is None
    assert p.pick([], d, 0) is None


def test_kv_usage_breaks_in_flight_ties_and_ties_rotate():
    d = ConcurrencyDetector(max_concurrency=4)
    p = EndpointPicker(max_concurrency=4)
    a = Replica("http://a", healthy=True, in_flight=1, kv_usage=0.9)
    b = Replica("http://b", healthy=True, in_flight=1, kv_usage=0.1)
    assert p.pick([a, b], d, 0) is b
    c = Replica("http://c", healthy=True)
    e = Replica("http://e", healthy=True)
    assert {p.pick([c, e], d, 0).url for _ in range(4)} == {"http://c", "http://e"}


def test_admission_fit_is_an_extra_filter():
    d = ConcurrencyDetector(max_concurrency=4)
    p = EndpointPicker(max_concurrency=4)
    a = Replica("http://a", healthy=True, in_flight=0)
    b = Replica("http://b", healthy=True, in_flight=3)
    assert p.pick([a, b], d, 0, fits=lambda r: r is b) is b


def test_scorers_by_name_see_kv_occupancy_including_reservations():
    d = ConcurrencyDetector(max_concurrency=4)
    occupancy = {"http://a": 0.5, "http://b": 0.2}
    a = Replica("http://a", healthy=True, in_flight=0)
    b = Replica("http://b", healthy=True, in_flight=3)
    least = EndpointPicker(max_concurrency=4, occupancy=lambda r: occupancy[r.url])
    assert least.pick([a, b], d, 0) is a          # 0 + 0.5 < 0.75 + 0.2
    headroom = EndpointPicker(max_concurrency=4, policy="kv-headroom", occupancy=lambda r: occupancy[r.url])
    assert headroom.pick([a, b], d, 0) is b       # most free KV blocks wins
    assert headroom.load(a).kv_occupancy == 0.5
