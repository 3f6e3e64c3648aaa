"""The gateway's /metrics page, read by the reference Prometheus text parser after real traffic.

Checks that the merged exposition parses, that each family appears once with sane values, that
the counters reflect the requests just sent, and that no URL or secret leaks into any label.
"""

from __future__ import annotations

import urllib.request

from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

MODEL = "metrics-model"
BACKEND_KEY = "sk-backend-planted-secret"


def fetch_metrics(gw) -> str:
    req = urllib.request.Request(gw.url + "/metrics", headers={"authorization": f"Bearer {gw.admin_token}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 200
        return resp.read().decode()


def test_metrics_parse_and_count_real_traffic(gateway, vllm_sim):
    gw = gateway()
    sims = [vllm_sim("--model", MODEL, "--time-scale", "50", "--seed", str(i), "--api-key", BACKEND_KEY) for i in range(2)]
    ids = [gw.register(s.base_url, [MODEL], api_key=BACKEND_KEY)["id"] for s in sims]
    for backend_id in ids:
        gw.wait_ready(backend_id)
    client = OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=10.0)
    for i in range(6):
        client.chat.completions.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": f"q{i}"}])

    text = fetch_metrics(gw)
    assert BACKEND_KEY not in text
    assert "http://" not in text and "https://" not in text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    # The parser strips `_total` from counter family names.
    for name in ("llm_gateway_requests", "llm_gateway_breaker_state", "llm_gateway_leases_in_flight",
                 "llm_gateway_ttfb_seconds", "llm_gateway_pool_desired_replicas", "llm_gateway_probes",
                 "llm_gateway_backend_scraped"):
        assert name in families, f"missing {name}; have {sorted(families)}"
    requests = sum(s.value for s in families["llm_gateway_requests"].samples if s.name.endswith("_total"))
    assert requests >= 6
    in_flight = [s.value for s in families["llm_gateway_leases_in_flight"].samples]
    assert all(v >= 0 for v in in_flight)
    for family in families.values():
        for sample in family.samples:
            for value in sample.labels.values():
                assert "://" not in value and BACKEND_KEY not in value
