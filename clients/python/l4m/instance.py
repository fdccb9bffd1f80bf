"""The handle a controller's `main(ctx)` receives: its arguments, the model, the user, shared
variables and child controllers."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from l4m.model import Model
from l4m.runtime import ChildExit, Runtime, SwapResult, Variable
from l4m.tokenizer import Tokenizer

if TYPE_CHECKING:  # a context's modules (generation, sampler, stop, window) load on its first use
    from l4m.context import Context


class SharedVariables:
    """Variables shared by the whole launch tree (the root and every child), with versions."""

    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime

    async def get(self, name: str) -> Variable:
        return await self._runtime.get(name)

    async def set(self, name: str, value: bytes | str) -> int:
        return await self._runtime.set(name, value)

    async def compare_and_set(self, name: str, expected_version: int, value: bytes | str) -> SwapResult:
        """Write only if the version is still `expected_version` (0: only if it does not exist yet)."""
        return await self._runtime.compare_and_set(name, expected_version, value)

    async def append(self, name: str, value: bytes | str) -> int:
        return await self._runtime.append(name, value)

    def watch(self, name: str) -> AsyncIterator[Variable]:
        """The current state, then every change."""
        return self._runtime.watch(name)

    async def wait_for(self, name: str) -> Variable:
        """Block (no polling) until `name` exists; its state then."""
        async for variable in self._runtime.watch(name):
            if variable.exists:
                return variable
        raise RuntimeError(f"the watch on {name!r} ended")


@dataclass
class Child:
    """A child controller this instance spawned."""

    instance_id: str
    _runtime: Runtime

    async def wait(self, timeout_s: float | None = None) -> ChildExit | None:
        """How it ended, or None when `timeout_s` passed first."""
        return await self._runtime.wait_child(self.instance_id, timeout_s)


class Instance:
    """`ctx` in `async def main(ctx)`."""

    def __init__(self, args: Sequence[str], model: Model, runtime: Runtime, instance_id: str) -> None:
        self.args = list(args)
        self.model = model  # the model this instance's session serves (`l4m run --model`, else the default)
        self.runtime = runtime
        self.instance_id = instance_id
        self.vars = SharedVariables(runtime)
        self._other_models: dict[str, Model] = {}

    async def load_model(self, name: str) -> Model:
        """Another model of the cluster (one of `ctx.model.served_model_names`), on a session of its own:
        its contexts, pages and exports are that model's. Opened once, closed when `main` returns; its
        tokens count against this instance's budget. An unknown name raises, naming the served ones."""
        if name == self.model.name:
            return self.model
        model = self._other_models.get(name)
        if model is None:
            session = await self.model.session.connect_to(name)
            try:
                model = await Model.load(session)
            except BaseException:
                await session.close()
                raise
            self._other_models[name] = model
        return model

    async def close_other_models(self) -> None:
        """End the sessions `load_model` opened (the scheduler frees what they held)."""
        models, self._other_models = list(self._other_models.values()), {}
        for model in models:
            await model.session.close()

    @property
    def tokenizer(self) -> Tokenizer:
        return self.model.tokenizer

    def new_context(self) -> Context:
        return self.model.new_context()

    async def send(self, text: str) -> None:
        """A message to the user (attached clients; stdout when run locally). Under a spawner that takes
        messages as frames (the default) it returns once the message is queued, not delivered: messages
        go out in order, and a refusal (the output limit used up) raises from a later `send` or `flush`.
        Everything sent reaches the spawner before the program's process ends."""
        await self.runtime.send(text)

    async def flush(self) -> None:
        """Returns once every message sent so far has reached the spawner (and its attached users)."""
        await self.runtime.flush()

    async def receive(self, timeout_s: float | None = None) -> str | None:
        """The next message from the user, or None on timeout / end of input."""
        return await self.runtime.receive(timeout_s)

    async def spawn(self, program: str = "", args: Sequence[str] = ()) -> Child:
        """Start a child controller (empty `program`: this same program) that shares `vars`."""
        return Child(await self.runtime.spawn_child(program, args), self.runtime)

    def log(self, *parts: object) -> None:
        """A log line (stderr; the spawner streams it to attached users)."""
        print(*parts, file=sys.stderr, flush=True)
