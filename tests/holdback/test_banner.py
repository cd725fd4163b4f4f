"""The `holdback up` banner's sample line names a model the replicas serve, not the example file's `sim-model`."""

from __future__ import annotations

import json

from holdback.cli.up import _first_line


def test_the_sample_line_names_the_served_model():
    line = json.loads(_first_line("tiny"))
    assert line["body"]["model"] == "tiny" and line["url"].startswith("/v1/")


def test_without_an_answer_from_the_replicas_the_line_says_to_set_the_model():
    text = _first_line(None)
    assert "put your served model's name in `model`" in text
