"""The gateway's prefix cache past its cap on a real `l4m up`: the least recently used prompt is unexported
through the gateway's admin maintenance instance, so its pages go back to the executor."""

from __future__ import annotations

import grpc
import openai

from l4m.v1 import l4m_pb2, l4m_pb2_grpc
from tests.integration.harness import UpCluster, up_cluster


def _free_pages(up: UpCluster) -> int:
    with grpc.insecure_channel(up.scheduler_address) as channel:
        info = l4m_pb2_grpc.L4MServiceStub(channel).GetInfo(l4m_pb2.GetInfoRequest(omit_tokenizer_json=True), timeout=30)
    return info.num_free_kv_pages


def test_past_its_cap_the_cache_unexports_the_least_recently_used_prompt(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with up_cluster(tmp_path, ["--gateway-prefix-cache-pages", "24"]) as up:
        client = openai.OpenAI(base_url=up.gateway_url, api_key=up.admin_key, max_retries=0, timeout=120)
        model = client.models.list().data[0].id

        def ask(topic: str) -> int:
            system = f"Notes on {topic}. " + " ".join(f"Fact {i} about {topic} is worth checking." for i in range(24))
            answer = client.chat.completions.create(model=model, temperature=0, max_tokens=2, messages=[
                {"role": "system", "content": system}, {"role": "user", "content": "Go on."}])
            assert answer.usage.prompt_tokens > 16 * 14  # more than half the cap: two do not fit
            return answer.usage.prompt_tokens_details.cached_tokens

        before = _free_pages(up)
        assert ask("rivers") == 0
        after_rivers = _free_pages(up)
        assert after_rivers < before - 10  # the cached prompt holds its pages
        assert ask("lakes") == 0  # cached too, and "rivers" evicted: over the cap of 24 pages together
        after_lakes = _free_pages(up)
        assert abs(after_lakes - after_rivers) <= 2  # "rivers" pages went back (not another ~15 held)
        assert ask("rivers") == 0  # no longer cached
        assert ask("rivers") > 0  # cached again
