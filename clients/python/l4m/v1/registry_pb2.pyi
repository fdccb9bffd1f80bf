from l4m.v1 import l4m_pb2 as _l4m_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterInstanceRequest(_message.Message):
    __slots__ = ("instance_id", "token", "max_tokens", "launched_at_unix_ms", "user", "is_admin", "parent_instance_id", "user_max_tokens_per_minute")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAUNCHED_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    IS_ADMIN_FIELD_NUMBER: _ClassVar[int]
    PARENT_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    USER_MAX_TOKENS_PER_MINUTE_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    token: str
    max_tokens: int
    launched_at_unix_ms: int
    user: str
    is_admin: bool
    parent_instance_id: str
    user_max_tokens_per_minute: int
    def __init__(self, instance_id: _Optional[str] = ..., token: _Optional[str] = ..., max_tokens: _Optional[int] = ..., launched_at_unix_ms: _Optional[int] = ..., user: _Optional[str] = ..., is_admin: _Optional[bool] = ..., parent_instance_id: _Optional[str] = ..., user_max_tokens_per_minute: _Optional[int] = ...) -> None: ...

class RegisterInstanceResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DestroyInstanceRequest(_message.Message):
    __slots__ = ("instance_id", "reason")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    reason: str
    def __init__(self, instance_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class DestroyInstanceResponse(_message.Message):
    __slots__ = ("num_kv_pages_freed", "num_embed_slots_freed")
    NUM_KV_PAGES_FREED_FIELD_NUMBER: _ClassVar[int]
    NUM_EMBED_SLOTS_FREED_FIELD_NUMBER: _ClassVar[int]
    num_kv_pages_freed: int
    num_embed_slots_freed: int
    def __init__(self, num_kv_pages_freed: _Optional[int] = ..., num_embed_slots_freed: _Optional[int] = ...) -> None: ...

class WatchInstanceEventsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchInstanceEventsResponse(_message.Message):
    __slots__ = ("instance_id", "trap")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    TRAP_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    trap: _l4m_pb2.Trap
    def __init__(self, instance_id: _Optional[str] = ..., trap: _Optional[_Union[_l4m_pb2.Trap, _Mapping]] = ...) -> None: ...
