"""Fuzz: ≥ 10,000 random and malformed commands from many sessions against a scheduler process and a
simulated executor process on loopback. The scheduler must not crash, every session that sent a bad
command must end with a trap naming that command and a non-empty reason (and a matching status),
well-behaved instances decoding meanwhile must get exactly the expected tokens, and at the end every
page and slot is back in the pool."""

from __future__ import annotations

import asyncio
import json
import random
import time

import grpc
from scheduler_procs import Cluster
from session_client import Session, greedy_decode

from l4m.scheduler import requests as rq
from l4m.scheduler.simulated import next_token
from l4m.v1 import common_pb2, l4m_pb2

VOCAB, PAGE_SIZE, MAX_CONTEXT = 1000, 16, 4096
NUM_COMMANDS = 10_000
NUM_CONCURRENT = 8
TRAP_STATUS = {
    l4m_pb2.TRAP_KIND_INVALID_COMMAND: grpc.StatusCode.INVALID_ARGUMENT,
    l4m_pb2.TRAP_KIND_RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    l4m_pb2.TRAP_KIND_UNSUPPORTED: grpc.StatusCode.FAILED_PRECONDITION,
}


class Fuzzer:
    """Commands for one session: valid ones built from what it owns, and now and then a bad one."""

    def __init__(self, rng: random.Random, session_no: int) -> None:
        self.rng = rng
        self.session_no = session_no
        self.pages: set[int] = set()
        self.frozen: set[int] = set()  # exported or imported: read-only, so never a write target
        self.slots: set[int] = set()
        self.exports: list[tuple[str, int]] = []
        self.next_id = 0

    def _fresh(self, count: int) -> list[int]:
        ids = list(range(self.next_id, self.next_id + count))
        self.next_id += count
        return ids

    def _writable(self) -> list[int]:
        return sorted(self.pages - self.frozen)

    def valid(self) -> l4m_pb2.SessionRequest:
        rng = self.rng
        choice = rng.random()
        if len(self._writable()) < 2 or choice < 0.1:
            ids = self._fresh(rng.randint(1, 3))
            self.pages.update(ids)
            return rq.allocate(ids)
        if choice < 0.15:
            ids = self._fresh(2)
            self.slots.update(ids)
            return rq.allocate(ids, kind=rq.EMBED_SLOT)
        if choice < 0.2 and len(self.pages) > 2:
            victim = rng.choice(sorted(self.pages))
            self.pages.discard(victim)
            self.frozen.discard(victim)
            return rq.deallocate([victim])
        writable = self._writable()
        if choice < 0.6:
            pages = rng.sample(writable, rng.randint(1, min(3, len(writable))))
            last = rng.randint(1, PAGE_SIZE)
            total = PAGE_SIZE * (len(pages) - 1) + last
            num_tokens = rng.randint(1, min(8, total))
            num_context = total - num_tokens
            masks = []
            if rng.random() < 0.3:
                masks = [[num_context + i + 1] if rng.random() < 0.5 else [1, num_context + i] for i in range(num_tokens)]
            outputs = sorted(rng.sample(range(num_tokens), rng.randint(0, min(2, num_tokens))))
            samplers = [rq.greedy() if rng.random() < 0.5 else
                        common_pb2.SamplerSpec(kind=common_pb2.SAMPLER_KIND_DISTRIBUTION, distribution_top_k=3)
                        for _ in outputs]
            return rq.forward_text(pages, last, [rng.randrange(VOCAB) for _ in range(num_tokens)],
                                   [num_context + i for i in range(num_tokens)], outputs=outputs, samplers=samplers,
                                   masks=masks)
        if choice < 0.65:
            source, destination = rng.choice(sorted(self.pages)), rng.choice(writable)
            return rq.request(copy_kv_page=common_pb2.CopyKvPageItem(
                source_kv_page_id=source, destination_kv_page_id=destination, source_offset_tokens=2,
                destination_offset_tokens=3, length_tokens=4))
        if choice < 0.7:
            return rq.request(mask_kv_page=common_pb2.MaskKvPageItem(
                kv_page_id=rng.choice(writable), visibility=common_pb2.Brle(run_lengths=[4, 2, 10])))
        if choice < 0.75 and self.slots:
            slot = rng.choice(sorted(self.slots))
            return rq.request(embed_text=common_pb2.EmbedTextItem(embed_slot_ids=[slot], token_ids=[3], position_ids=[0]))
        if choice < 0.8 and self.slots:
            return rq.request(sample_top_k=common_pb2.SampleTopKItem(embed_slot_id=rng.choice(sorted(self.slots)), k=2))
        if choice < 0.85:
            name = f"s{self.session_no}-e{len(self.exports)}"
            page = rng.choice(sorted(self.pages))
            self.exports.append((name, 1))
            self.frozen.add(page)
            # Not persistent: an anonymous session is a user of its own, so nobody else could unexport it.
            return rq.export(name, [page])
        if choice < 0.88 and self.exports:
            name, count = self.exports[-1]
            ids = self._fresh(count)
            self.pages.update(ids)
            self.frozen.update(ids)
            return rq.import_pages(name, ids)
        if choice < 0.9:
            return rq.request(list_exports=l4m_pb2.ListExportsCommand())
        if choice < 0.95:
            return rq.synchronize(stream_id=rng.randint(0, 2))
        return rq.debug_query("ping")

    def malformed(self) -> l4m_pb2.SessionRequest:
        rng = self.rng
        page = rng.choice(sorted(self.pages)) if self.pages else 0
        unowned = 100_000 + rng.randrange(1000)
        bad = [
            lambda: rq.forward_text([unowned], 1, [1], [0]),
            lambda: rq.forward_text([page], 1, [VOCAB + rng.randrange(99)], [0]),
            lambda: rq.forward_text([page], 0, [1], [0]),
            lambda: rq.forward_text([page], 2, [1, 2], [0, 1], masks=[[1], [1]]),
            lambda: rq.forward_text([page], 2, [1, 2], [0, 1], outputs=[5]),
            lambda: rq.forward_text([page], 1, [1], [MAX_CONTEXT]),
            lambda: rq.forward_text([page], 1, [1], [0], outputs=[0], samplers=[common_pb2.SamplerSpec()]),
            lambda: rq.deallocate([unowned]),
            lambda: rq.allocate([page] if self.pages else [1, 1]),
            lambda: rq.request(sample_top_k=common_pb2.SampleTopKItem(embed_slot_id=unowned, k=1)),
            lambda: rq.request(copy_kv_page=common_pb2.CopyKvPageItem(
                source_kv_page_id=page, destination_kv_page_id=page, source_offset_tokens=15, length_tokens=2)),
            lambda: rq.request(mask_kv_page=common_pb2.MaskKvPageItem(
                kv_page_id=page, visibility=common_pb2.Brle(run_lengths=[PAGE_SIZE + 1]))),
            lambda: rq.debug_query(f"nonsense-{rng.randrange(100)}"),
            lambda: rq.request(),
            lambda: rq.import_pages(f"missing-{rng.randrange(100)}", [unowned]),
            lambda: rq.unexport(f"missing-{rng.randrange(100)}"),
            lambda: rq.request(embed_image=common_pb2.EmbedImageItem(embed_slot_ids=[0], image_bytes=b"x")),
        ]
        return rng.choice(bad)()


async def _fuzz_session(channel: grpc.aio.Channel, rng: random.Random, session_no: int, counter: list[int]) -> None:
    fuzzer = Fuzzer(rng, session_no)
    num_commands = rng.randint(20, 100)
    bad_at = rng.randrange(num_commands) if rng.random() < 0.7 else None
    session = Session(channel)
    bad_request_id = None
    for i in range(num_commands):
        request = fuzzer.malformed() if i == bad_at else fuzzer.valid()
        request.request_id = i + 1
        if i == bad_at:
            bad_request_id = request.request_id
        counter[0] += 1
        if not await session.write(request):
            break
        if i == bad_at:
            break
    if bad_request_id is None:
        done = session.expect(10_000)
        await session.write(rq.synchronize(request_id=10_000))
        await done
    await session.close()
    trap = session.trap
    if bad_request_id is None:
        assert trap is None and session.status == grpc.StatusCode.OK, (trap, session.details)
    else:
        assert trap is not None, f"session {session_no}: bad request {bad_request_id} got no trap"
        assert trap.offending_request_id == bad_request_id, trap
        assert trap.reason and session.details == trap.reason
        assert session.status == TRAP_STATUS[trap.kind], (session.status, trap)


async def _well_behaved(channel: grpc.aio.Channel, seed: int, stop: asyncio.Event) -> int:
    rng = random.Random(seed)
    num_runs = 0
    while not stop.is_set() or num_runs == 0:
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))]
        session = Session(channel)
        generated = await greedy_decode(session, prompt, 10, PAGE_SIZE)
        await session.close()
        expected, last, position = [], prompt[-1], len(prompt) - 1
        for _ in range(10):
            last = next_token(last, position, VOCAB)
            expected.append(last)
            position += 1
        assert generated == expected and session.status == grpc.StatusCode.OK
        num_runs += 1
    return num_runs


async def _run(address: str) -> None:
    rng = random.Random(1234)
    counter = [0]
    started = time.monotonic()
    async with grpc.aio.insecure_channel(address) as channel:
        stop = asyncio.Event()
        good = [asyncio.create_task(_well_behaved(channel, seed, stop)) for seed in range(3)]
        session_no = 0
        running: set[asyncio.Task[None]] = set()
        while counter[0] < NUM_COMMANDS or running:
            while counter[0] < NUM_COMMANDS and len(running) < NUM_CONCURRENT:
                session_no += 1
                running.add(asyncio.create_task(_fuzz_session(channel, random.Random(rng.random()), session_no, counter)))
            done, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
        stop.set()
        good_runs = sum(await asyncio.gather(*good))
        probe = Session(channel)
        stats = json.loads((await probe.ask(rq.debug_query("stats", request_id=1))).debug_query.response)
        # Every export went with its (anonymous) exporter: the pools are whole again.
        final = json.loads((await probe.ask(rq.debug_query("stats", request_id=3))).debug_query.response)
        await probe.close()
    elapsed = time.monotonic() - started
    print(f"fuzz: {counter[0]} commands in {session_no} sessions, {good_runs} good decodes, {elapsed:.1f}s; "
          f"traps={stats['traps']}")
    assert counter[0] >= NUM_COMMANDS
    assert sum(stats["traps"].values()) > 100
    assert final["batch_errors"] == 0
    assert final["instances_active"] == 1 and final["queued"] == 0 and final["exports"] == 0
    executor = final["executors"][0]
    assert executor["kv_pages_free"] == executor["kv_pages_total"], executor
    assert executor["embed_slots_free"] == executor["embed_slots_total"], executor
    assert elapsed < 60


def test_fuzz_never_crashes_traps_every_bad_command_and_frees_everything(cluster: Cluster) -> None:
    executor = cluster.simulated_executor("--num-kv-pages", "4096", "--num-embed-slots", "4096")
    scheduler = cluster.scheduler(executor)
    asyncio.run(_run(scheduler))
    assert all(p.process.poll() is None for p in cluster.processes), "a process died"
