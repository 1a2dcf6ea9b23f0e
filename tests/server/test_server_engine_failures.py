"""The engine's failure counters (engine/failure_policy.py) reach /metrics."""

import dataclasses

from server_helpers import metric, parse_prometheus
from starlette.testclient import TestClient

from exlcli.client.fake import FakeClient
from exlcli.server.app import create_app


class FailingEngineClient(FakeClient):
    def stats(self):
        return dataclasses.replace(super().stats(), step_failures=7, requests_failed=3, nonfinite_logits=2)


def test_engine_failure_counters_are_in_metrics():
    with TestClient(create_app(FailingEngineClient())) as http:
        _, samples = parse_prometheus(http.get("/metrics").text)
    assert metric(samples, "exlcli_engine_step_failures_total") == 7
    assert metric(samples, "exlcli_engine_requests_failed_total") == 3
    assert metric(samples, "exlcli_engine_nonfinite_logits_total") == 2
