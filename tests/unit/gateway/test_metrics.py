"""The gateway's Prometheus metrics (metrics.py), in process: the app over `FakeBackend`, reached through an
ASGI transport (no socket), its registry read as a scrape would. Requests by endpoint and status code, their
latency to the end of the answer (a stream's last chunk), the tokens the answers' usage reports, the prefix
cache's counts, and the `--metrics-port`/`--metrics-host` flags (bad values are usage errors)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx2
import openai
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from l4m.common.metrics import LOOPBACK, MetricsEndpoint
from l4m.common.users import Authenticator
from l4m.fake import FakeL4M
from l4m.gateway.__main__ import parse_config
from l4m.gateway.backend import FakeBackend
from l4m.gateway.config import GatewayConfig
from l4m.gateway.metrics import GatewayMetrics, RequestMetrics
from l4m.gateway.server import create_app
from l4m.keys import KeyStore

MODEL = "fake-tiny"
CHAT = "/v1/chat/completions"
SYSTEM = "You answer questions about the sea, briefly and with care. " * 3


class Gateway:
    def __init__(self, tmp_path: Path, prefix_cache_pages: int = 0) -> None:
        keys = KeyStore.load(tmp_path / "keys.json")
        self.key = keys.add("alice")
        keys.save()
        self.metrics = GatewayMetrics()
        self.app = create_app(GatewayConfig(prefix_cache_pages=prefix_cache_pages),
                              FakeBackend(FakeL4M(), prefix_cache_pages=prefix_cache_pages),
                              Authenticator(tmp_path / "keys.json"), metrics=self.metrics)
        self.http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=self.app), base_url="http://gateway")
        self.client = openai.AsyncOpenAI(api_key=self.key, base_url="http://gateway/v1", http_client=self.http,
                                         max_retries=0)

    async def post(self, path: str, body: object, key: str | None = None) -> httpx2.Response:
        headers = {"authorization": f"Bearer {key or self.key}", "content-type": "application/json"}
        return await self.http.post(path, content=json.dumps(body), headers=headers)

    def scrape(self) -> dict[str, float]:
        """Every sample of the registry's exposition text: `name{label="value",...}` -> value."""
        samples = {}
        for family in text_string_to_metric_families(generate_latest(self.metrics.registry).decode()):
            for sample in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
        return samples


def _messages(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


async def test_answered_completions_count_their_requests_latency_and_usage_tokens(tmp_path: Path) -> None:
    gateway = Gateway(tmp_path)
    whole = await gateway.client.chat.completions.create(model=MODEL, messages=_messages("Hi?"), max_tokens=5, n=2,
                                                         temperature=0)
    stream = await gateway.client.completions.create(model=MODEL, prompt="The sea is", max_tokens=4, stream=True,
                                                     stream_options={"include_usage": True})
    streamed_usage = None
    async for chunk in stream:
        streamed_usage = chunk.usage or streamed_usage
    assert whole.usage is not None and streamed_usage is not None
    samples = gateway.scrape()
    assert samples['l4m_gateway_requests_total{code="200",endpoint="/v1/chat/completions"}'] == 1
    assert samples['l4m_gateway_requests_total{code="200",endpoint="/v1/completions"}'] == 1
    assert samples['l4m_gateway_request_seconds_count{endpoint="/v1/completions"}'] == 1
    assert samples['l4m_gateway_request_seconds_bucket{endpoint="/v1/chat/completions",le="+Inf"}'] == 1
    assert samples["l4m_gateway_prompt_tokens_total"] == whole.usage.prompt_tokens + streamed_usage.prompt_tokens
    assert samples["l4m_gateway_generated_tokens_total"] == (whole.usage.completion_tokens
                                                             + streamed_usage.completion_tokens) > 0
    assert samples["l4m_gateway_cached_prompt_tokens_total"] == 0
    # A stream the client reads without asking for usage still counts its tokens.
    stream = await gateway.client.completions.create(model=MODEL, prompt="The sea is", max_tokens=3, stream=True,
                                                     extra_body={"ignore_eos": True})
    async for _ in stream:
        pass
    assert gateway.scrape()["l4m_gateway_generated_tokens_total"] == samples["l4m_gateway_generated_tokens_total"] + 3


async def test_a_stream_is_timed_to_its_last_chunk_not_its_headers() -> None:
    observed: list[tuple[str, int, float]] = []

    class Recorder(GatewayMetrics):
        def observe_request(self, path: str, status: int, seconds: float) -> None:
            observed.append((path, status, seconds))

    async def slow_stream(scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await asyncio.sleep(0.2)
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=RequestMetrics(slow_stream, Recorder())),
                              base_url="http://gateway")
    await http.post(CHAT, content=b"{}")
    [(path, status, seconds)] = observed
    assert (path, status) == (CHAT, 200) and seconds >= 0.2


async def test_refused_requests_count_under_their_status_and_unknown_paths_under_one_label(tmp_path: Path) -> None:
    gateway = Gateway(tmp_path)
    assert (await gateway.post(CHAT, {"model": MODEL, "messages": _messages("Hi")}, key="sk-wrong")).status_code == 401
    assert (await gateway.post(CHAT, {"model": MODEL, "messages": []})).status_code == 400
    assert (await gateway.post(CHAT, {"model": "nope", "messages": _messages("Hi")})).status_code == 404
    too_big = {"model": MODEL, "messages": _messages("x" * (5 << 20))}
    assert (await gateway.post(CHAT, too_big)).status_code == 413
    for index in range(20):  # made-up paths: one label value, not one per path
        assert (await gateway.http.get(f"/v1/made-up-{index}")).status_code == 404
    samples = gateway.scrape()
    for code in ("401", "400", "404", "413"):
        assert samples[f'l4m_gateway_requests_total{{code="{code}",endpoint="/v1/chat/completions"}}'] == 1, code
    assert samples['l4m_gateway_requests_total{code="404",endpoint="other"}'] == 20
    endpoints = {key.split('endpoint="')[1].split('"')[0] for key in samples if key.startswith("l4m_gateway_requests")}
    assert endpoints == {"/v1/chat/completions", "other"}
    assert samples["l4m_gateway_prompt_tokens_total"] == samples["l4m_gateway_generated_tokens_total"] == 0


async def test_the_prefix_caches_hits_misses_and_pages_are_read_at_scrape_time(tmp_path: Path) -> None:
    gateway = Gateway(tmp_path, prefix_cache_pages=128)
    samples = gateway.scrape()
    assert samples["l4m_gateway_prefix_cache_hits_total"] == samples["l4m_gateway_prefix_cache_misses_total"] == 0
    first = await gateway.client.chat.completions.create(model=MODEL, messages=_messages("What is a tide?"),
                                                         max_tokens=4, temperature=0)
    second = await gateway.client.chat.completions.create(model=MODEL, messages=_messages("Why is the sea salty?"),
                                                          max_tokens=4, temperature=0)
    assert first.usage is not None and second.usage is not None
    cached = second.usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]
    assert cached > 0
    samples = gateway.scrape()
    assert samples["l4m_gateway_prefix_cache_misses_total"] == 1
    assert samples["l4m_gateway_prefix_cache_hits_total"] == 1
    assert samples["l4m_gateway_prefix_cache_entries"] >= 1 and samples["l4m_gateway_prefix_cache_pages"] > 0
    assert samples["l4m_gateway_prefix_cache_evictions_total"] == 0
    assert samples["l4m_gateway_cached_prompt_tokens_total"] == cached


def _argv(*flags: str) -> list[str]:
    return ["--insecure-local", *flags]


def test_metrics_are_off_and_on_loopback_unless_the_flags_say_otherwise() -> None:
    assert parse_config(_argv()).metrics == MetricsEndpoint(0, LOOPBACK)
    assert parse_config(_argv("--metrics-port", "9412")).metrics == MetricsEndpoint(9412, LOOPBACK)
    assert parse_config(_argv("--metrics-port", "9412", "--metrics-host", "0.0.0.0")).metrics == \
        MetricsEndpoint(9412, "0.0.0.0")


@pytest.mark.parametrize(("flags", "message"), [
    (("--metrics-port", "70000"), "--metrics-port must be in 0..65535 (0: off), got 70000"),
    (("--metrics-port", "9412", "--metrics-host", "everywhere"), "--metrics-host must be an IP address"),
])
def test_bad_metrics_flags_are_usage_errors_naming_the_flag(flags: tuple[str, ...], message: str,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse_config(_argv(*flags))
    assert exit_.value.code == 2 and message in capsys.readouterr().err
