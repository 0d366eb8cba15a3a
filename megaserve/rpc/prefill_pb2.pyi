from megaserve.rpc import decode_pb2 as _decode_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Transport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSPORT_GRPC: _ClassVar[Transport]
    TRANSPORT_JAX_TRANSFER: _ClassVar[Transport]
TRANSPORT_GRPC: Transport
TRANSPORT_JAX_TRANSFER: Transport

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "decode_address", "cached_pages", "page_size", "transport", "resumed_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    RESUMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _decode_pb2.SamplingParams
    decode_address: str
    cached_pages: int
    page_size: int
    transport: Transport
    resumed_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_decode_pb2.SamplingParams, _Mapping]] = ..., decode_address: _Optional[str] = ..., cached_pages: _Optional[int] = ..., page_size: _Optional[int] = ..., transport: _Optional[_Union[Transport, str]] = ..., resumed_tokens: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token", "pages_sent", "bytes_sent", "prefix_hit_pages", "compute_ms", "transfer_ms", "first_chunk_sent_ms")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PAGES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_PAGES_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    FIRST_CHUNK_SENT_MS_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    pages_sent: int
    bytes_sent: int
    prefix_hit_pages: int
    compute_ms: float
    transfer_ms: float
    first_chunk_sent_ms: float
    def __init__(self, first_token: _Optional[int] = ..., pages_sent: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., prefix_hit_pages: _Optional[int] = ..., compute_ms: _Optional[float] = ..., transfer_ms: _Optional[float] = ..., first_chunk_sent_ms: _Optional[float] = ...) -> None: ...

class PrefillEvent(_message.Message):
    __slots__ = ("first_token", "done")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    first_token: FirstToken
    done: PrefillResponse
    def __init__(self, first_token: _Optional[_Union[FirstToken, _Mapping]] = ..., done: _Optional[_Union[PrefillResponse, _Mapping]] = ...) -> None: ...

class FirstToken(_message.Message):
    __slots__ = ("token", "compute_ms")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    token: int
    compute_ms: float
    def __init__(self, token: _Optional[int] = ..., compute_ms: _Optional[float] = ...) -> None: ...
