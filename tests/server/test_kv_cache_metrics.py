"""/metrics and the serve display name the KV cache's types (-ctk / -ctv, --kv-cache-dtype)."""

from server_helpers import metric, parse_prometheus
from starlette.testclient import TestClient

from exlcli.client.fake import FakeClient
from exlcli.engine.stats import EngineStats
from exlcli.server.app import create_app
from exlcli.server.dashboard import DashboardSnapshot, cache_parts


class QuantizedCacheClient(FakeClient):
    def stats(self) -> EngineStats:
        return EngineStats(pages_total=64, page_size=16, kv_cache_type_k="q8_0", kv_cache_type_v="q4_0")


def test_the_cache_types_are_a_metric_and_on_the_display():
    with TestClient(create_app(QuantizedCacheClient())) as http:
        types, samples = parse_prometheus(http.get("/metrics").text)
    assert types["exlcli_kv_cache_info"] == "gauge"
    assert metric(samples, "exlcli_kv_cache_info", type_k="q8_0", type_v="q4_0") == 1
    with TestClient(create_app(FakeClient())) as http:  # no cache, no types
        types, _ = parse_prometheus(http.get("/metrics").text)
    assert "exlcli_kv_cache_info" not in types
    snapshot = DashboardSnapshot("http://x", "m", QuantizedCacheClient().stats(), [], [], 0, 0, 0)
    assert cache_parts(snapshot)[2].startswith("K q8_0 V q4_0, pages 0/64")


class GroupedCacheClient(FakeClient):
    def stats(self) -> EngineStats:
        return EngineStats(pages_total=600, pages_used=150, page_size=16, kv_cache_type_k="bf16",
                           kv_cache_type_v="bf16", page_group_windows=["full", "1024", "1024"],
                           pages_used_by_group=[130, 10, 10])


def test_pages_per_layer_group_are_a_metric():
    with TestClient(create_app(GroupedCacheClient())) as http:
        types, samples = parse_prometheus(http.get("/metrics").text)
    assert types["exlcli_kv_pages_used_by_group"] == "gauge"
    assert metric(samples, "exlcli_kv_pages_used_by_group", group="0", window="full") == 130
    assert metric(samples, "exlcli_kv_pages_used_by_group", group="2", window="1024") == 10
    with TestClient(create_app(QuantizedCacheClient())) as http:  # one group: no per-group gauge
        types, _ = parse_prometheus(http.get("/metrics").text)
    assert "exlcli_kv_pages_used_by_group" not in types
