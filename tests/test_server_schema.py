"""A bounded schemathesis pass over /openapi.json: whatever a schema-driven client or fuzzer sends
to any operation, the server answers without a 5xx.

The server runs with a 64-token context, so no generated request (whatever its max_tokens or n)
runs long; each operation gets up to 30 generated examples.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, seed, settings

from schemathesis.generation import GenerationMode

from serverproc import Server

KEY = "sk-fuzz"


@pytest.fixture(scope="module")
def fuzz_server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("schema-logs") / "fuzz.log"
    server = Server(tiny_llama, log, "--max-model-len", "64", "--max-waiting", "8", "--api-key", KEY, api_key=KEY)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


OPERATIONS = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/v1/tokenize"),
              ("POST", "/v1/detokenize"), ("GET", "/v1/models"), ("GET", "/health"), ("GET", "/metrics")]


@pytest.fixture(scope="module")
def api_schema(fuzz_server: Server) -> schemathesis.schemas.BaseSchema:
    return schemathesis.openapi.from_url(f"{fuzz_server.base}/openapi.json")


def test_schema_lists_every_operation(api_schema: schemathesis.schemas.BaseSchema) -> None:
    found = {(op.ok().method.upper(), op.ok().path) for op in api_schema.get_all_operations()}
    assert found == set(OPERATIONS)


CASES = [(m, p, mode) for m, p in OPERATIONS for mode in (["positive", "negative"] if m == "POST" else ["positive"])]


@pytest.mark.parametrize("method,path,mode", CASES, ids=[f"{m} {p} {mode}" for m, p, mode in CASES])
def test_no_operation_answers_5xx(api_schema: schemathesis.schemas.BaseSchema, fuzz_server: Server,
                                  method: str, path: str, mode: str) -> None:
    """Up to 30 generated requests per operation and mode (schema-valid bodies, and bodies that
    break the schema): every answer is below 500."""
    operation = api_schema[path][method]
    headers = {"Authorization": f"Bearer {KEY}"}
    statuses: list[int] = []

    @seed(20261123)  # the same 30 examples every run
    @given(case=operation.as_strategy(GenerationMode(mode)))
    @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), database=None,
              phases=[Phase.explicit, Phase.generate])
    def check(case: schemathesis.Case) -> None:
        response = case.call(base_url=fuzz_server.base, headers=headers, timeout=60)
        statuses.append(response.status_code)
        assert response.status_code < 500, (
            f"{case.method} {case.path} -> {response.status_code}: {response.text[:500]}\n"
            f"body: {case.body!r}\n{fuzz_server.log()}"
        )

    check()
    assert statuses


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/tokenize", "/v1/detokenize"])
def test_documented_examples_are_served(fuzz_server: Server, path: str) -> None:
    """Each request model's example in /openapi.json is a request the server answers with 200."""
    schema = fuzz_server.http.get("/openapi.json").json()
    ref = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    model = schema["components"]["schemas"][ref.rsplit("/", 1)[1]]
    for example in model["examples"]:
        res = fuzz_server.http.post(path, json=example)
        assert res.status_code == 200, (example, res.text)
