"""Several models behind one scheduler: a session binds to one when it opens and stays on that model's
executors, limits and exports; an unknown model is refused naming the served ones."""

from __future__ import annotations

import grpc
import pytest

from l4m.scheduler import requests as rq
from l4m.scheduler.errors import TooManyInstances
from l4m.scheduler.models import UnknownModel
from l4m.scheduler.server import SessionRefused, admit_session
from l4m.v1 import l4m_pb2
from tests.unit.scheduler.conftest import ListSink

TRAP = l4m_pb2.TrapKind


def _two_models(harness_factory, **config):  # type: ignore[no-untyped-def]
    """Executor 0 serves "alpha" (vocabulary 1000), executor 1 "beta" (vocabulary 500)."""
    return harness_factory(executor_configs=[{"model_name": "alpha"}, {"model_name": "beta", "vocab_size": 500}],
                           **config)


async def test_sessions_bind_to_the_executors_of_the_model_they_name(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = _two_models(harness_factory)
    await h.settle()
    on_default, _ = h.open("d")
    on_beta, _ = h.open("b", model="beta")
    on_alpha, _ = h.open("a", model="alpha")
    for instance in (on_default, on_beta, on_alpha):
        h.send(instance, rq.allocate([1, 2]))
    await h.settle()
    assert on_default.executor.index == 0 and on_alpha.executor.index == 0  # the first executor's model is the default
    assert on_beta.executor.index == 1
    assert h.free_pages(0) == 60 and h.free_pages(1) == 62


async def test_get_info_describes_one_model_and_lists_all(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = _two_models(harness_factory)
    await h.settle()
    default, beta = h.scheduler.get_info(), h.scheduler.get_info(model_name="beta")
    assert default.model.name == "alpha" and default.model.vocab_size == 1000
    assert beta.model.name == "beta" and beta.model.vocab_size == 500 and beta.num_executors == 1
    assert list(default.model_names) == list(beta.model_names) == ["alpha", "beta"]
    with pytest.raises(UnknownModel, match="model 'gamma' is not served here; served: alpha, beta"):
        h.scheduler.get_info(model_name="gamma")
    instance, sink = h.open("b", model="beta")
    h.send(instance, rq.request(request_id=4, get_info=l4m_pb2.GetInfoCommand(omit_tokenizer_json=True)))
    await h.settle()
    assert sink.of("info")[0].info.model.name == "beta"  # a session's GetInfoCommand is about its own model


async def test_commands_are_checked_against_their_own_models_limits(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = _two_models(harness_factory)
    await h.settle()
    on_alpha, alpha_sink = h.open("a", model="alpha")
    on_beta, beta_sink = h.open("b", model="beta")
    for instance in (on_alpha, on_beta):
        h.send(instance, rq.allocate([1]), rq.forward_text([1], 1, [700], outputs=[0], request_id=9))
    await h.settle()
    assert alpha_sink.trap is None and len(alpha_sink.of("forward_text")) == 1
    assert beta_sink.trap is not None and beta_sink.trap.kind == TRAP.TRAP_KIND_INVALID_COMMAND
    assert "700" in beta_sink.trap.reason and "500" in beta_sink.trap.reason
    assert h.free_pages(1) == 64  # the trapped instance's pages are back


async def test_exports_are_per_model(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = _two_models(harness_factory)
    await h.settle()
    exporter, _ = h.open("exporter", model="alpha")
    h.send(exporter, rq.allocate([1]), rq.forward_text([1], 1, [3]), rq.export("prefix", [1], is_public=True))
    await h.settle()
    on_beta, beta_sink = h.open("importer-b", model="beta")
    h.send(on_beta, rq.request(request_id=1, list_exports=l4m_pb2.ListExportsCommand()),
           rq.import_pages("prefix", [5], request_id=2))
    await h.settle()
    assert list(beta_sink.of("list_exports")[0].list_exports.exports) == []
    assert beta_sink.trap is not None and "no export is named 'prefix'" in beta_sink.trap.reason
    own, own_sink = h.open("exporter-b", model="beta")  # beta's namespace is its own: the name is free there
    h.send(own, rq.allocate([1]), rq.export("prefix", [1], is_public=True), rq.synchronize(request_id=3))
    await h.settle()
    assert own_sink.trap is None
    on_alpha, alpha_sink = h.open("importer-a", model="alpha")
    h.send(on_alpha, rq.import_pages("prefix", [5], request_id=4))
    await h.settle()
    assert alpha_sink.trap is None and on_alpha.executor.index == 0  # alpha's export, on alpha's executor


async def test_a_session_naming_an_unknown_model_is_refused_before_it_registers(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = _two_models(harness_factory, config={"allow_anonymous": True})
    await h.settle()
    num_before = len(h.scheduler.instances)
    with pytest.raises(SessionRefused) as refused:
        admit_session(h.scheduler, None, "gamma")
    assert refused.value.code == grpc.StatusCode.NOT_FOUND
    assert refused.value.message == "model 'gamma' is not served here; served: alpha, beta"
    assert len(h.scheduler.instances) == num_before  # no anonymous instance was left behind
    instance, model = admit_session(h.scheduler, None, "beta")
    assert model.name == "beta" and instance.is_anonymous


async def test_a_controller_opens_one_session_per_model_each_its_own_tables(harness_factory) -> None:  # type: ignore[no-untyped-def]
    """`ctx.load_model`: the same token opens a session on another model. It speaks for a companion
    instance (the tokens it feeds charged to the main one too); a second session on a model that has one
    is refused; a companion's trap ends only itself; the main session's end ends every companion."""
    h = _two_models(harness_factory)
    await h.settle()
    main = h.scheduler.register_instance("ctl", "token-of-ctl-0123456789", 100, 1000, user="carol")
    main_sink, beta_sink = ListSink(), ListSink()
    assert h.scheduler.open_session(main, main_sink) is main
    beta = h.scheduler.open_session(main, beta_sink, model=h.scheduler.served_model("beta"))
    assert beta is not main and beta.companion_of is main and beta.user == "carol" and beta.model.name == "beta"
    with pytest.raises(ValueError, match="one session per instance and model"):
        h.scheduler.open_session(main, ListSink(), model=h.scheduler.served_model("beta"))
    with pytest.raises(ValueError, match="one session per instance and model"):
        h.scheduler.open_session(main, ListSink())  # the main model's session is open too
    h.send(main, rq.allocate([1]), rq.forward_text([1], 3, [1, 2, 3]))
    h.send(beta, rq.allocate([1]), rq.forward_text([1], 4, [1, 2, 3, 4], outputs=[3], request_id=5))
    await h.settle()
    assert main.executor.index == 0 and beta.executor.index == 1
    assert main.num_tokens_used == 7 and beta.num_tokens_used == 4  # the companion's tokens count for the main one
    h.send(beta, rq.forward_text([9], 1, [1]))  # a page it does not hold: traps the companion alone
    await h.settle()
    assert beta_sink.trap is not None and main_sink.trap is None and main.is_alive
    assert h.free_pages(1) == 64 and "ctl@beta" not in {i.instance_id for i in h.scheduler.instances}
    again_sink = ListSink()
    again = h.scheduler.open_session(main, again_sink, model=h.scheduler.served_model("beta"))  # a fresh companion
    h.send(again, rq.allocate([2]))
    await h.settle()
    h.scheduler.close_session(main)
    assert again_sink.trap is not None and again_sink.trap.kind == TRAP.TRAP_KIND_DESTROYED
    assert "main session ended" in again_sink.trap.reason
    assert h.free_pages(0) == 64 and h.free_pages(1) == 64
    assert not main.companions and "ctl@beta" not in {i.instance_id for i in h.scheduler.instances}


async def test_a_companion_counts_against_max_instances(harness_factory) -> None:  # type: ignore[no-untyped-def]
    """A session on a second model registers an instance: past --max-instances it is refused (the servers
    answer RESOURCE_EXHAUSTED), the main session untouched."""
    h = _two_models(harness_factory, config={"max_instances": 1})
    await h.settle()
    main, sink = h.open("m")
    with pytest.raises(TooManyInstances):
        h.scheduler.open_session(main, ListSink(), model=h.scheduler.served_model("beta"))
    assert main.is_alive and not main.companions and sink.trap is None
