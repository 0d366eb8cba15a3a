from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Checksum(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CHECKSUM_UNSPECIFIED: _ClassVar[Checksum]
    CHECKSUM_CRC32: _ClassVar[Checksum]
    CHECKSUM_XXH3_64: _ClassVar[Checksum]

class CacheKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CACHE_KIND_UNSPECIFIED: _ClassVar[CacheKind]
    CACHE_KIND_PAGED_KV: _ClassVar[CacheKind]
CHECKSUM_UNSPECIFIED: Checksum
CHECKSUM_CRC32: Checksum
CHECKSUM_XXH3_64: Checksum
CACHE_KIND_UNSPECIFIED: CacheKind
CACHE_KIND_PAGED_KV: CacheKind

class KVTrailer(_message.Message):
    __slots__ = ("first_token",)
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    def __init__(self, first_token: _Optional[int] = ...) -> None: ...

class KVHeader(_message.Message):
    __slots__ = ("request_id", "num_layers", "first_page", "num_pages", "dtype", "cache_kind", "page_size", "head_start", "head_end", "head_dim", "has_scales", "layout_version", "checksum")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    FIRST_PAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CACHE_KIND_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    HEAD_START_FIELD_NUMBER: _ClassVar[int]
    HEAD_END_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    HAS_SCALES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_VERSION_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_layers: int
    first_page: int
    num_pages: int
    dtype: str
    cache_kind: CacheKind
    page_size: int
    head_start: int
    head_end: int
    head_dim: int
    has_scales: bool
    layout_version: int
    checksum: Checksum
    def __init__(self, request_id: _Optional[str] = ..., num_layers: _Optional[int] = ..., first_page: _Optional[int] = ..., num_pages: _Optional[int] = ..., dtype: _Optional[str] = ..., cache_kind: _Optional[_Union[CacheKind, str]] = ..., page_size: _Optional[int] = ..., head_start: _Optional[int] = ..., head_end: _Optional[int] = ..., head_dim: _Optional[int] = ..., has_scales: _Optional[bool] = ..., layout_version: _Optional[int] = ..., checksum: _Optional[_Union[Checksum, str]] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("layer_start", "layer_end", "page_index", "shape", "data", "checksum", "pull")
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    PAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    PULL_FIELD_NUMBER: _ClassVar[int]
    layer_start: int
    layer_end: int
    page_index: _containers.RepeatedScalarFieldContainer[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    checksum: int
    pull: PullRef
    def __init__(self, layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., page_index: _Optional[_Iterable[int]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., checksum: _Optional[int] = ..., pull: _Optional[_Union[PullRef, _Mapping]] = ...) -> None: ...

class PullRef(_message.Message):
    __slots__ = ("address", "uuid", "arrays")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    ARRAYS_FIELD_NUMBER: _ClassVar[int]
    address: str
    uuid: int
    arrays: int
    def __init__(self, address: _Optional[str] = ..., uuid: _Optional[int] = ..., arrays: _Optional[int] = ...) -> None: ...

class KVPush(_message.Message):
    __slots__ = ("header", "chunk", "trailer")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    header: KVHeader
    chunk: KVChunk
    trailer: KVTrailer
    def __init__(self, header: _Optional[_Union[KVHeader, _Mapping]] = ..., chunk: _Optional[_Union[KVChunk, _Mapping]] = ..., trailer: _Optional[_Union[KVTrailer, _Mapping]] = ...) -> None: ...

class KVPushResponse(_message.Message):
    __slots__ = ("bytes", "chunks")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    chunks: int
    def __init__(self, bytes: _Optional[int] = ..., chunks: _Optional[int] = ...) -> None: ...
