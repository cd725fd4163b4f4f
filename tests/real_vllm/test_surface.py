"""The simulator answers as vLLM does: one request suite replayed against `holdback sim` and a live vLLM, their
records diffed (status codes, body keys and types, SSE framing, error envelopes, /tokenize, /v1/models, metric names
and labels). Empty apart from the deliberate differences `surface.DELIBERATE` and model_sim/README.md list.
"""

from __future__ import annotations

import json

import pytest

from tests.real_vllm.conftest import CONTEXT, PRIORITIES, SERVED
from tests.real_vllm.surface import diff, probe
from tests.support import Processes, free_port, wait_http

pytestmark = pytest.mark.e2e


@pytest.fixture
def sim(tmp_path):
    port = free_port()
    with Processes(log_dir=tmp_path / "logs", nice=PRIORITIES.stack_nice) as procs:
        proc = procs.start("sim", "--port", str(port), "--model", SERVED, "--max-model-len", str(CONTEXT),
                           "--runner", "generate", "--enable-prefix-caching", "--block-size", "128",
                           "--num-blocks", "16384", name="sim")
        wait_http(f"http://127.0.0.1:{port}/health", timeout=60, proc=proc)
        yield f"http://127.0.0.1:{port}"


def test_the_simulator_answers_the_suite_as_vllm_does(vllm, sim):
    engine = probe(vllm.url, SERVED)
    simulated = probe(sim, SERVED)
    differences = diff(engine, simulated)
    assert not differences, "model_sim differs from vLLM:\n" + "\n".join(differences) + "\n\nvLLM's records:\n" + \
        json.dumps({k: engine[k] for k in sorted(engine) if any(d.startswith(k) for d in differences)}, indent=1)[:6000]
