from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LogStream(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LOG_STREAM_UNSPECIFIED: _ClassVar[LogStream]
    LOG_STREAM_STDOUT: _ClassVar[LogStream]
    LOG_STREAM_STDERR: _ClassVar[LogStream]

class ExitReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EXIT_REASON_UNSPECIFIED: _ClassVar[ExitReason]
    EXIT_REASON_EXITED: _ClassVar[ExitReason]
    EXIT_REASON_CRASHED: _ClassVar[ExitReason]
    EXIT_REASON_TERMINATED: _ClassVar[ExitReason]
    EXIT_REASON_WALL_TIME_LIMIT: _ClassVar[ExitReason]
    EXIT_REASON_CPU_TIME_LIMIT: _ClassVar[ExitReason]
    EXIT_REASON_MEMORY_LIMIT: _ClassVar[ExitReason]
    EXIT_REASON_PROCESS_LIMIT: _ClassVar[ExitReason]
    EXIT_REASON_OUTPUT_LIMIT: _ClassVar[ExitReason]
    EXIT_REASON_TRAPPED: _ClassVar[ExitReason]
    EXIT_REASON_LAUNCH_FAILED: _ClassVar[ExitReason]
    EXIT_REASON_PARENT_EXITED: _ClassVar[ExitReason]
    EXIT_REASON_KILLED: _ClassVar[ExitReason]

class InstanceState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INSTANCE_STATE_UNSPECIFIED: _ClassVar[InstanceState]
    INSTANCE_STATE_STARTING: _ClassVar[InstanceState]
    INSTANCE_STATE_RUNNING: _ClassVar[InstanceState]
    INSTANCE_STATE_EXITED: _ClassVar[InstanceState]
LOG_STREAM_UNSPECIFIED: LogStream
LOG_STREAM_STDOUT: LogStream
LOG_STREAM_STDERR: LogStream
EXIT_REASON_UNSPECIFIED: ExitReason
EXIT_REASON_EXITED: ExitReason
EXIT_REASON_CRASHED: ExitReason
EXIT_REASON_TERMINATED: ExitReason
EXIT_REASON_WALL_TIME_LIMIT: ExitReason
EXIT_REASON_CPU_TIME_LIMIT: ExitReason
EXIT_REASON_MEMORY_LIMIT: ExitReason
EXIT_REASON_PROCESS_LIMIT: ExitReason
EXIT_REASON_OUTPUT_LIMIT: ExitReason
EXIT_REASON_TRAPPED: ExitReason
EXIT_REASON_LAUNCH_FAILED: ExitReason
EXIT_REASON_PARENT_EXITED: ExitReason
EXIT_REASON_KILLED: ExitReason
INSTANCE_STATE_UNSPECIFIED: InstanceState
INSTANCE_STATE_STARTING: InstanceState
INSTANCE_STATE_RUNNING: InstanceState
INSTANCE_STATE_EXITED: InstanceState

class UploadProgramRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: ProgramHeader
    chunk: bytes
    def __init__(self, header: _Optional[_Union[ProgramHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class ProgramHeader(_message.Message):
    __slots__ = ("size_bytes", "sha256", "tag", "filename")
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    FILENAME_FIELD_NUMBER: _ClassVar[int]
    size_bytes: int
    sha256: str
    tag: str
    filename: str
    def __init__(self, size_bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., tag: _Optional[str] = ..., filename: _Optional[str] = ...) -> None: ...

class UploadProgramResponse(_message.Message):
    __slots__ = ("sha256", "size_bytes", "already_present")
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ALREADY_PRESENT_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    size_bytes: int
    already_present: bool
    def __init__(self, sha256: _Optional[str] = ..., size_bytes: _Optional[int] = ..., already_present: _Optional[bool] = ...) -> None: ...

class ListProgramsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListProgramsResponse(_message.Message):
    __slots__ = ("programs",)
    PROGRAMS_FIELD_NUMBER: _ClassVar[int]
    programs: _containers.RepeatedCompositeFieldContainer[ProgramInfo]
    def __init__(self, programs: _Optional[_Iterable[_Union[ProgramInfo, _Mapping]]] = ...) -> None: ...

class ProgramInfo(_message.Message):
    __slots__ = ("sha256", "size_bytes", "tags")
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TAGS_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    size_bytes: int
    tags: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, sha256: _Optional[str] = ..., size_bytes: _Optional[int] = ..., tags: _Optional[_Iterable[str]] = ...) -> None: ...

class Limits(_message.Message):
    __slots__ = ("wall_time_ms", "cpu_time_ms", "memory_bytes", "max_processes", "max_open_files", "max_output_bytes", "max_tokens", "max_children")
    WALL_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    CPU_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_PROCESSES_FIELD_NUMBER: _ClassVar[int]
    MAX_OPEN_FILES_FIELD_NUMBER: _ClassVar[int]
    MAX_OUTPUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_CHILDREN_FIELD_NUMBER: _ClassVar[int]
    wall_time_ms: int
    cpu_time_ms: int
    memory_bytes: int
    max_processes: int
    max_open_files: int
    max_output_bytes: int
    max_tokens: int
    max_children: int
    def __init__(self, wall_time_ms: _Optional[int] = ..., cpu_time_ms: _Optional[int] = ..., memory_bytes: _Optional[int] = ..., max_processes: _Optional[int] = ..., max_open_files: _Optional[int] = ..., max_output_bytes: _Optional[int] = ..., max_tokens: _Optional[int] = ..., max_children: _Optional[int] = ...) -> None: ...

class LaunchRequest(_message.Message):
    __slots__ = ("program", "args", "limits", "detached", "model", "share_process")
    PROGRAM_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    DETACHED_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SHARE_PROCESS_FIELD_NUMBER: _ClassVar[int]
    program: str
    args: _containers.RepeatedScalarFieldContainer[str]
    limits: Limits
    detached: bool
    model: str
    share_process: bool
    def __init__(self, program: _Optional[str] = ..., args: _Optional[_Iterable[str]] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., detached: _Optional[bool] = ..., model: _Optional[str] = ..., share_process: _Optional[bool] = ...) -> None: ...

class LaunchResponse(_message.Message):
    __slots__ = ("instance_id",)
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    def __init__(self, instance_id: _Optional[str] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("instance_id", "batch_events")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    BATCH_EVENTS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    batch_events: bool
    def __init__(self, instance_id: _Optional[str] = ..., batch_events: _Optional[bool] = ...) -> None: ...

class AttachResponse(_message.Message):
    __slots__ = ("message", "log", "exit", "events")
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    LOG_FIELD_NUMBER: _ClassVar[int]
    EXIT_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    message: InstanceMessage
    log: LogLine
    exit: InstanceExit
    events: _containers.RepeatedCompositeFieldContainer[AttachResponse]
    def __init__(self, message: _Optional[_Union[InstanceMessage, _Mapping]] = ..., log: _Optional[_Union[LogLine, _Mapping]] = ..., exit: _Optional[_Union[InstanceExit, _Mapping]] = ..., events: _Optional[_Iterable[_Union[AttachResponse, _Mapping]]] = ...) -> None: ...

class InstanceMessage(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class LogLine(_message.Message):
    __slots__ = ("stream", "line")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    LINE_FIELD_NUMBER: _ClassVar[int]
    stream: LogStream
    line: str
    def __init__(self, stream: _Optional[_Union[LogStream, str]] = ..., line: _Optional[str] = ...) -> None: ...

class InstanceExit(_message.Message):
    __slots__ = ("reason", "exit_code", "signal", "message")
    REASON_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    reason: ExitReason
    exit_code: int
    signal: int
    message: str
    def __init__(self, reason: _Optional[_Union[ExitReason, str]] = ..., exit_code: _Optional[int] = ..., signal: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class SendMessageRequest(_message.Message):
    __slots__ = ("instance_id", "text")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    text: str
    def __init__(self, instance_id: _Optional[str] = ..., text: _Optional[str] = ...) -> None: ...

class SendMessageResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TerminateRequest(_message.Message):
    __slots__ = ("instance_id",)
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    def __init__(self, instance_id: _Optional[str] = ...) -> None: ...

class TerminateResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListInstancesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListInstancesResponse(_message.Message):
    __slots__ = ("instances",)
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    instances: _containers.RepeatedCompositeFieldContainer[InstanceInfo]
    def __init__(self, instances: _Optional[_Iterable[_Union[InstanceInfo, _Mapping]]] = ...) -> None: ...

class InstanceInfo(_message.Message):
    __slots__ = ("instance_id", "program_sha256", "args", "state", "exit", "parent_instance_id", "launched_at_unix_ms", "user", "detached", "shared_process")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    PROGRAM_SHA256_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    EXIT_FIELD_NUMBER: _ClassVar[int]
    PARENT_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    LAUNCHED_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    DETACHED_FIELD_NUMBER: _ClassVar[int]
    SHARED_PROCESS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    program_sha256: str
    args: _containers.RepeatedScalarFieldContainer[str]
    state: InstanceState
    exit: InstanceExit
    parent_instance_id: str
    launched_at_unix_ms: int
    user: str
    detached: bool
    shared_process: str
    def __init__(self, instance_id: _Optional[str] = ..., program_sha256: _Optional[str] = ..., args: _Optional[_Iterable[str]] = ..., state: _Optional[_Union[InstanceState, str]] = ..., exit: _Optional[_Union[InstanceExit, _Mapping]] = ..., parent_instance_id: _Optional[str] = ..., launched_at_unix_ms: _Optional[int] = ..., user: _Optional[str] = ..., detached: _Optional[bool] = ..., shared_process: _Optional[str] = ...) -> None: ...

class SendToUserRequest(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class FramedRuntimeOpen(_message.Message):
    __slots__ = ("protocol_version", "instance_token", "traceparent", "process_token")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    PROCESS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    protocol_version: str
    instance_token: str
    traceparent: str
    process_token: str
    def __init__(self, protocol_version: _Optional[str] = ..., instance_token: _Optional[str] = ..., traceparent: _Optional[str] = ..., process_token: _Optional[str] = ...) -> None: ...

class FramedRuntimeCall(_message.Message):
    __slots__ = ("call_id", "receive_from_user", "get_variable", "set_variable", "compare_and_set_variable", "append_variable", "spawn_child", "wait_child")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    RECEIVE_FROM_USER_FIELD_NUMBER: _ClassVar[int]
    GET_VARIABLE_FIELD_NUMBER: _ClassVar[int]
    SET_VARIABLE_FIELD_NUMBER: _ClassVar[int]
    COMPARE_AND_SET_VARIABLE_FIELD_NUMBER: _ClassVar[int]
    APPEND_VARIABLE_FIELD_NUMBER: _ClassVar[int]
    SPAWN_CHILD_FIELD_NUMBER: _ClassVar[int]
    WAIT_CHILD_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    receive_from_user: ReceiveFromUserRequest
    get_variable: GetVariableRequest
    set_variable: SetVariableRequest
    compare_and_set_variable: CompareAndSetVariableRequest
    append_variable: AppendVariableRequest
    spawn_child: SpawnChildRequest
    wait_child: WaitChildRequest
    def __init__(self, call_id: _Optional[int] = ..., receive_from_user: _Optional[_Union[ReceiveFromUserRequest, _Mapping]] = ..., get_variable: _Optional[_Union[GetVariableRequest, _Mapping]] = ..., set_variable: _Optional[_Union[SetVariableRequest, _Mapping]] = ..., compare_and_set_variable: _Optional[_Union[CompareAndSetVariableRequest, _Mapping]] = ..., append_variable: _Optional[_Union[AppendVariableRequest, _Mapping]] = ..., spawn_child: _Optional[_Union[SpawnChildRequest, _Mapping]] = ..., wait_child: _Optional[_Union[WaitChildRequest, _Mapping]] = ...) -> None: ...

class FramedRuntimeResult(_message.Message):
    __slots__ = ("call_id", "code", "message", "receive_from_user", "get_variable", "set_variable", "compare_and_set_variable", "append_variable", "spawn_child", "wait_child")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RECEIVE_FROM_USER_FIELD_NUMBER: _ClassVar[int]
    GET_VARIABLE_FIELD_NUMBER: _ClassVar[int]
    SET_VARIABLE_FIELD_NUMBER: _ClassVar[int]
    COMPARE_AND_SET_VARIABLE_FIELD_NUMBER: _ClassVar[int]
    APPEND_VARIABLE_FIELD_NUMBER: _ClassVar[int]
    SPAWN_CHILD_FIELD_NUMBER: _ClassVar[int]
    WAIT_CHILD_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    code: int
    message: str
    receive_from_user: ReceiveFromUserResponse
    get_variable: GetVariableResponse
    set_variable: SetVariableResponse
    compare_and_set_variable: CompareAndSetVariableResponse
    append_variable: AppendVariableResponse
    spawn_child: SpawnChildResponse
    wait_child: WaitChildResponse
    def __init__(self, call_id: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., receive_from_user: _Optional[_Union[ReceiveFromUserResponse, _Mapping]] = ..., get_variable: _Optional[_Union[GetVariableResponse, _Mapping]] = ..., set_variable: _Optional[_Union[SetVariableResponse, _Mapping]] = ..., compare_and_set_variable: _Optional[_Union[CompareAndSetVariableResponse, _Mapping]] = ..., append_variable: _Optional[_Union[AppendVariableResponse, _Mapping]] = ..., spawn_child: _Optional[_Union[SpawnChildResponse, _Mapping]] = ..., wait_child: _Optional[_Union[WaitChildResponse, _Mapping]] = ...) -> None: ...

class FramedRuntimeCancel(_message.Message):
    __slots__ = ("call_id",)
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    def __init__(self, call_id: _Optional[int] = ...) -> None: ...

class SharedProcessSlot(_message.Message):
    __slots__ = ("instance_id", "instance_token", "args", "traceparent", "stop")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    instance_token: str
    args: _containers.RepeatedScalarFieldContainer[str]
    traceparent: str
    stop: bool
    def __init__(self, instance_id: _Optional[str] = ..., instance_token: _Optional[str] = ..., args: _Optional[_Iterable[str]] = ..., traceparent: _Optional[str] = ..., stop: _Optional[bool] = ...) -> None: ...

class SharedProcessReport(_message.Message):
    __slots__ = ("instance_id", "stdout", "stderr", "exit")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    STDOUT_FIELD_NUMBER: _ClassVar[int]
    STDERR_FIELD_NUMBER: _ClassVar[int]
    EXIT_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    stdout: bytes
    stderr: bytes
    exit: SharedProcessExit
    def __init__(self, instance_id: _Optional[str] = ..., stdout: _Optional[bytes] = ..., stderr: _Optional[bytes] = ..., exit: _Optional[_Union[SharedProcessExit, _Mapping]] = ...) -> None: ...

class SharedProcessExit(_message.Message):
    __slots__ = ("exit_code", "message")
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    exit_code: int
    message: str
    def __init__(self, exit_code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class SendToUserResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReceiveFromUserRequest(_message.Message):
    __slots__ = ("timeout_ms",)
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    timeout_ms: int
    def __init__(self, timeout_ms: _Optional[int] = ...) -> None: ...

class ReceiveFromUserResponse(_message.Message):
    __slots__ = ("received", "text")
    RECEIVED_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    received: bool
    text: str
    def __init__(self, received: _Optional[bool] = ..., text: _Optional[str] = ...) -> None: ...

class GetVariableRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class GetVariableResponse(_message.Message):
    __slots__ = ("exists", "value", "version")
    EXISTS_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    exists: bool
    value: bytes
    version: int
    def __init__(self, exists: _Optional[bool] = ..., value: _Optional[bytes] = ..., version: _Optional[int] = ...) -> None: ...

class SetVariableRequest(_message.Message):
    __slots__ = ("name", "value")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    name: str
    value: bytes
    def __init__(self, name: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...

class SetVariableResponse(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class CompareAndSetVariableRequest(_message.Message):
    __slots__ = ("name", "expected_version", "value")
    NAME_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    name: str
    expected_version: int
    value: bytes
    def __init__(self, name: _Optional[str] = ..., expected_version: _Optional[int] = ..., value: _Optional[bytes] = ...) -> None: ...

class CompareAndSetVariableResponse(_message.Message):
    __slots__ = ("swapped", "version", "value")
    SWAPPED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    swapped: bool
    version: int
    value: bytes
    def __init__(self, swapped: _Optional[bool] = ..., version: _Optional[int] = ..., value: _Optional[bytes] = ...) -> None: ...

class AppendVariableRequest(_message.Message):
    __slots__ = ("name", "value")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    name: str
    value: bytes
    def __init__(self, name: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...

class AppendVariableResponse(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class WatchVariableRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class WatchVariableResponse(_message.Message):
    __slots__ = ("exists", "value", "version")
    EXISTS_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    exists: bool
    value: bytes
    version: int
    def __init__(self, exists: _Optional[bool] = ..., value: _Optional[bytes] = ..., version: _Optional[int] = ...) -> None: ...

class SpawnChildRequest(_message.Message):
    __slots__ = ("program", "args", "limits")
    PROGRAM_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    program: str
    args: _containers.RepeatedScalarFieldContainer[str]
    limits: Limits
    def __init__(self, program: _Optional[str] = ..., args: _Optional[_Iterable[str]] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ...) -> None: ...

class SpawnChildResponse(_message.Message):
    __slots__ = ("instance_id",)
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    def __init__(self, instance_id: _Optional[str] = ...) -> None: ...

class WaitChildRequest(_message.Message):
    __slots__ = ("instance_id", "timeout_ms")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    timeout_ms: int
    def __init__(self, instance_id: _Optional[str] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class WaitChildResponse(_message.Message):
    __slots__ = ("exited", "exit")
    EXITED_FIELD_NUMBER: _ClassVar[int]
    EXIT_FIELD_NUMBER: _ClassVar[int]
    exited: bool
    exit: InstanceExit
    def __init__(self, exited: _Optional[bool] = ..., exit: _Optional[_Union[InstanceExit, _Mapping]] = ...) -> None: ...
