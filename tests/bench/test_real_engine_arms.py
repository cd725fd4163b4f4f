"""Every arm of the real-engine study is a config the gateway accepts (no key given twice, none unknown)."""

import pytest

from bench.real_engine_study import BASE_CONFIG, CALLERS, SLOTS, arms
from gateway.config import parse_config


@pytest.mark.parametrize("arm", [a for a in arms(SLOTS) if a.gateway is not None], ids=lambda a: a.name)
def test_each_gateway_arm_parses(arm):
    text = (BASE_CONFIG % {"slots": SLOTS} if arm.shared else CALLERS) + arm.gateway
    parse_config(text, f"{arm.name}.yaml", env={})
