"""The models a scheduler serves: each executor serves one; executors of the same model pool together.

A session binds to one model when it opens (the `l4m-model` metadata, or the framed opening's `model`;
empty means the default, the model of the first `--executor`) and stays on that model's executors:
its commands are checked against that model's limits, it binds to one of that model's executors,
and it sees only that model's exports (KV pages mean nothing to another model).
"""

from __future__ import annotations

from dataclasses import dataclass

from l4m.scheduler.validation import ModelLimits
from l4m.v1 import common_pb2
from l4m.wire.rules import tokenizer_digest


@dataclass
class ServedModel:
    """One model as the scheduler serves it: what its executors reported, and the limits of their pool."""

    name: str
    info: common_pb2.ModelInfo
    info_without_tokenizer: common_pb2.ModelInfo  # for GetInfo(omit_tokenizer_json)
    limits: ModelLimits | None = None  # None until one of its executors connected

    @classmethod
    def from_info(cls, info: common_pb2.ModelInfo) -> ServedModel:
        """`info` as its executor reported it, named by its tokenizer's digest (`tokenizer_sha256`)."""
        named = common_pb2.ModelInfo()
        named.CopyFrom(info)
        named.tokenizer_sha256 = tokenizer_digest(info.tokenizer_json)
        without = common_pb2.ModelInfo()
        without.CopyFrom(named)
        without.ClearField("tokenizer_json")
        return cls(info.name, named, without)


class UnknownModel(LookupError):
    """A session or GetInfo named a model no executor of this scheduler serves."""

    def __init__(self, name: str, served: list[str]) -> None:
        super().__init__(f"model {name!r} is not served here; served: {', '.join(served) or 'none yet'}")
