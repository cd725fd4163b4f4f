"""Schemathesis fuzzes every operation of the API's own OpenAPI document against a live server (both
backends; `make test`'s second pass is PostgreSQL, where a NUL byte used to become a 500).

Valid and invalid requests alike must get no 5xx, only the statuses the document lists, and every error in
the OpenAI envelope. The run is bounded by Hypothesis's example count per operation (see FUZZ_SETTINGS).
A NUL in every id, cursor and filter of every operation is swept on top: random strings seldom hold one.
"""

from __future__ import annotations

import io

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import negative_data_rejection

from tests.batch_api.test_errors import LINE

# Per operation and mode; 24 operations, so about 450 requests in all (about 30 s on two loaded cores).
EXAMPLES_PER_OPERATION = 15
FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES_PER_OPERATION,
    deadline=None,  # a loaded two-core machine is slow, not wrong
    phases=[Phase.explicit, Phase.generate],  # no shrinking: a failure is reported as found
    suppress_health_check=list(HealthCheck),
    database=None,
)


def _auth(keys: dict[str, str], path: str) -> dict[str, str]:
    key = next((k for prefix, k in keys.items() if path.startswith(prefix)), None)
    return {"authorization": f"Bearer {key}"} if key else {}


# Every built-in check but one: a schema-valid request may still be refused for what a schema cannot say
# (a batch file must be named *.jsonl and hold JSONL; a batch needs a file of purpose=batch).
FUZZ_CONFIG = schemathesis.Config.from_dict({"checks": {"positive_data_acceptance": {"enabled": False}}})


@pytest.fixture
def fuzz_keys(api):  # noqa: ANN001
    """A tenant with a file and a batch, so some generated requests meet real rows."""
    key = api.create_key("fuzz")
    client = api.openai(key)
    file = client.files.create(file=("a.jsonl", io.BytesIO(LINE)), purpose="batch")
    client.batches.create(input_file_id=file.id, endpoint="/v1/embeddings", completion_window="24h")
    return {"/v1/": key, "/admin/": api.settings.admin_key}


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_every_operation_answers_as_its_schema_says(api, fuzz_keys, mode):  # noqa: ANN001
    # Schemathesis's Python API: the schema from the live server, one Hypothesis strategy per operation.
    # (Its pytest plugin, `schemathesis.pytest.from_fixture`, does not run under pytest 9.)
    schema = schemathesis.openapi.from_url(f"{api.url}/openapi.json", config=FUZZ_CONFIG)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 20, [op.label for op in operations]
    skipped: list[str] = []
    for operation in operations:
        if mode is GenerationMode.NEGATIVE and not (operation.query or operation.body):
            # Only ids in the path, and an id may be any string: no request breaks the schema (Hypothesis
            # would report Unsatisfiable). Positive mode still sends them arbitrary strings.
            skipped.append(operation.label)
            continue
        headers = _auth(fuzz_keys, operation.path)

        @FUZZ_SETTINGS
        @given(case=operation.as_strategy(mode))
        def answers(case: schemathesis.Case) -> None:
            excluded = [negative_data_rejection] if _lost_in_the_form(case) else []
            response = case.call_and_validate(base_url=api.url, headers=headers, timeout=30,
                                              excluded_checks=excluded)
            assert response.status_code < 500, (case.method, case.path, response.text)
            if response.status_code >= 400 and case.path != "/readyz":
                body = response.json()
                assert set(body) == {"error"}, body
                assert set(body["error"]) == {"message", "type", "param", "code"}, body
                assert body["error"]["message"], body

        answers()
    print(f"{mode}: fuzzed {len(operations) - len(skipped)} of {len(operations)} operations; skipped {skipped}")


def _lost_in_the_form(case: schemathesis.Case) -> bool:
    """A multipart field whose generated value is an empty array is sent as no part at all: the request on the
    wire is the one without that field, so a negative case whose breach was that array may arrive valid (an
    upload without `expires_after`) and be rightly accepted. Its other checks (no 5xx, the error envelope) hold."""
    return (case.media_type or "").startswith("multipart/") and isinstance(case.body, dict) \
        and any(value == [] for value in case.body.values())


def _free_text(parameter) -> bool:  # noqa: ANN001 - schemathesis's OpenAPI parameter
    """A string parameter with no enum: an id, a cursor or a filter, where a NUL could reach the database."""
    schema = parameter.definition.get("schema", {})
    options = schema.get("anyOf", [schema])
    return any(option.get("type") == "string" and "enum" not in option and "pattern" not in option
               for option in options)


def test_a_nul_in_every_free_text_parameter_is_a_400(api, fuzz_keys):  # noqa: ANN001
    # Random strings rarely hold a NUL, so every operation is also sent one in each id, cursor and filter.
    schema = schemathesis.openapi.from_url(f"{api.url}/openapi.json", config=FUZZ_CONFIG)
    swept = []
    for operation in (result.ok() for result in schema.get_all_operations()):
        headers = _auth(fuzz_keys, operation.path)
        targets = [(p.location, p.name) for p in [*operation.path_parameters, *operation.query] if _free_text(p)]
        for location, name in targets:
            fixed = {"path_parameters" if location.value == "path" else "query": {name: "x\x00y"}}

            @settings(FUZZ_SETTINGS, max_examples=3)
            @given(case=operation.as_strategy(GenerationMode.POSITIVE, **fixed))
            def refused(case: schemathesis.Case) -> None:
                response = case.call_and_validate(base_url=api.url, headers=headers, timeout=30)
                assert response.status_code == 400, (operation.label, name, response.text)
                error = response.json()["error"]
                assert error["code"] == "invalid_characters" and error["param"] == name, error

            refused()
            swept.append(f"{operation.label} {name}")
    assert len(swept) >= 15, swept
