"""A small, exact reader of GGUF files (llama.cpp's model format) for the executor's loader.

gguf-py's `GGUFReader` builds a numpy view for every part of every metadata value: a tokenizer of
~49k tokens and ~49k merges costs seconds. This reader parses the header, the metadata key/values
and the tensor infos with `struct` from a few big reads of the file's start (strings in a plain loop,
arrays of numbers as one `np.frombuffer`), and exposes each tensor's data as a view of one `np.memmap`.

Reads GGUF versions 2 and 3, little-endian:
- `fields`: key -> plain Python value (str, int, float, bool, or a list of those; an array of arrays
  is a list of lists, where gguf-py flattens it). gguf-py's pseudo-keys `GGUF.version`,
  `GGUF.tensor_count` and `GGUF.kv_count` are not fields (they are `version` and `len(tensors)`).
- `tensors`: name, `gguf.GGMLQuantizationType`, `shape` as gguf-py reports it (innermost dimension
  first; a tuple of ints where gguf-py has a uint64 array) and `data` with gguf-py's dtype and shape: F16, F32, F64, I8..I64 typed `[rows..., cols]`,
  every other type (BF16 and the block types) uint8 `[rows..., bytes per row]`, which is what
  `gguf.quants.dequantize` takes.
- Tensor data starts at the end of the tensor infos rounded up to `general.alignment` (default 32).

Refuses, with a `ValueError` naming the file and what is wrong: a bad magic, a file that ends
inside the header, the metadata, the tensor infos or a tensor's data, an unknown metadata value
type, a string that is not UTF-8, a duplicate key or tensor name, a `general.alignment` that is not
a power-of-two uint32, a quantized row that is not whole blocks, arrays nested more than 8 deep. Refuses with `UnsupportedModel` (a
`ValueError`): another version (GGUF v1 or newer than 3), a big-endian file, an unknown tensor type.
Every count is checked against the bytes left before it is looped over, so a corrupt count fails at
once instead of looping.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from l4m.executor.architectures import UnsupportedModel

SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
_MAGIC = b"GGUF"
_HEADER = struct.Struct("<4sIQQ")  # magic, version, tensor count, metadata key/value count
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_ARRAY_HEADER = struct.Struct("<IQ")  # item type, item count
_TENSOR_TYPE_OFFSET = struct.Struct("<IQ")  # a tensor's GGML type, its offset in the data region
_MAX_ARRAY_DEPTH = 8
# The first read of the header region; SmolLM2's metadata (49k tokens and merges) is 1.8 MB.
FIRST_READ_BYTES = 4 << 20

# GGUF metadata value types (gguf.GGUFValueType): 0..7 and 10..12 are numbers, 8 a string, 9 an array.
_UINT32, _STRING, _ARRAY = 4, 8, 9
_NUMBER_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_SCALARS = {t: struct.Struct("<" + f) for t, f in _NUMBER_FORMATS.items()}
_ARRAY_DTYPES = {t: np.dtype("<" + f) for t, f in _NUMBER_FORMATS.items()}
# The fewest bytes one item of each type takes: a string is at least its length, an array its header.
_MIN_ITEM_SIZE = {**{t: s.size for t, s in _SCALARS.items()}, _STRING: 8, _ARRAY: _ARRAY_HEADER.size}

# Tensor types gguf-py exposes as typed elements; every other type is raw bytes per row.
_ELEMENT_DTYPES = {
    GGMLQuantizationType.F16: np.dtype(np.float16), GGMLQuantizationType.F32: np.dtype(np.float32),
    GGMLQuantizationType.F64: np.dtype(np.float64), GGMLQuantizationType.I8: np.dtype(np.int8),
    GGMLQuantizationType.I16: np.dtype(np.int16), GGMLQuantizationType.I32: np.dtype(np.int32),
    GGMLQuantizationType.I64: np.dtype(np.int64),
}


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    """One tensor: `shape` in ggml order (innermost first), `data` a read-only view of the file."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    n_elements: int
    n_bytes: int
    data_offset: int  # from the start of the file
    data: np.ndarray


@dataclass(frozen=True)
class GGUFFile:
    """A parsed GGUF file; the tensors' data stay mapped while any of them is referenced."""

    path: Path
    version: int
    alignment: int
    data_offset: int  # where the tensor data region starts
    fields: dict[str, object]
    tensors: list[GGUFTensor]


class _Cursor:
    """Reads little-endian values at `pos` of the file's first bytes, `buf`, which grows by a few big reads
    as parsing needs (slicing bytes is ~2x faster than slicing a memory map); `what` names the part being
    read, for errors."""

    def __init__(self, path: Path, file: BinaryIO, size: int) -> None:
        self.path, self.file, self.size = path, file, size
        self.buf, self.pos = b"", 0
        self.what = "the header"

    def error(self, problem: str) -> ValueError:
        return ValueError(f"{self.path}: {self.what} {problem}")

    def left(self) -> int:
        return self.size - self.pos

    def take(self, size: int) -> int:
        """Skips `size` bytes; returns where they start."""
        start = self.pos
        if start + size > len(self.buf):
            self._read_to(start + size)
        self.pos = start + size
        return start

    def _read_to(self, end: int) -> None:
        if end > self.size:
            raise self.error(f"runs past the end of the file (needs {end - self.pos} bytes at offset {self.pos}, "
                             f"the file has {self.size}): the file is truncated or corrupt")
        want = min(self.size, max(end, 2 * len(self.buf), FIRST_READ_BYTES))
        self.buf += self.file.read(want - len(self.buf))
        if len(self.buf) < end:  # the file shrank under us
            self.size = len(self.buf)
            self._read_to(end)

    def unpack(self, layout: struct.Struct) -> tuple:
        start = self.take(layout.size)  # before reading `buf`: taking may grow it
        return layout.unpack_from(self.buf, start)

    def string(self) -> str:
        (size,) = self.unpack(_U64)
        start = self.take(size)
        return self.buf[start:start + size].decode()

    def strings(self, count: int) -> list[str]:
        # The hot loop (a tokenizer holds ~100k strings), over the bytes read so far; the string that
        # crosses their end goes through `string`, which reads more or fails.
        out: list[str] = []
        append, unpack = out.append, _U64.unpack_from
        while len(out) < count:
            buf, pos = self.buf, self.pos
            end = len(buf)
            for _ in range(count - len(out)):
                if pos + 8 > end:
                    break
                (size,) = unpack(buf, pos)
                if pos + 8 + size > end:
                    break
                append(buf[pos + 8:pos + 8 + size].decode())
                pos += 8 + size
            self.pos = pos
            if len(out) < count:
                append(self.string())
        return out

    def value(self, value_type: int, depth: int = 0) -> object:
        scalar = _SCALARS.get(value_type)
        if scalar is not None:
            return self.unpack(scalar)[0]
        if value_type == _STRING:
            return self.string()
        if value_type != _ARRAY:
            raise self.error(f"has unknown value type {value_type}")
        item_type, count = self.unpack(_ARRAY_HEADER)
        if item_type not in _MIN_ITEM_SIZE:
            raise self.error(f"is an array of unknown value type {item_type}")
        if count * _MIN_ITEM_SIZE[item_type] > self.left():
            raise self.error(f"holds {count} items, more than the {self.left()} bytes left in the file can: "
                             "the file is truncated or corrupt")
        if item_type in _ARRAY_DTYPES:
            dtype = _ARRAY_DTYPES[item_type]
            start = self.take(count * dtype.itemsize)
            return np.frombuffer(self.buf, dtype, count, start).tolist()
        if item_type == _STRING:
            return self.strings(count)
        if depth >= _MAX_ARRAY_DEPTH:
            raise self.error(f"nests arrays deeper than {_MAX_ARRAY_DEPTH}")
        return [self.value(_ARRAY, depth + 1) for _ in range(count)]


def read_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Parses `path`'s metadata and tensor infos; tensor data are views of one read-only memory map."""
    path = Path(path)
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        if size < _HEADER.size:
            raise ValueError(f"{path}: not a GGUF file ({size} bytes, shorter than the {_HEADER.size}-byte header)")
        cursor = _Cursor(path, file, size)
        magic, version, tensor_count, kv_count = cursor.unpack(_HEADER)
        _check_header(path, magic, version)
        fields = _read_fields(cursor, kv_count)
        infos = _read_tensor_infos(cursor, tensor_count)
        alignment = _alignment(path, fields)
        data_offset = -(-cursor.pos // alignment) * alignment
        mapped = np.memmap(file, dtype=np.uint8, mode="r")
    tensors = [_tensor(path, mapped, data_offset, *info) for info in infos]
    return GGUFFile(path, version, alignment, data_offset, fields, tensors)


def _check_header(path: Path, magic: bytes, version: int) -> None:
    if magic != _MAGIC:
        raise ValueError(f"{path}: not a GGUF file (magic {magic!r}, expected {_MAGIC!r})")
    if version not in SUPPORTED_VERSIONS and version and version & 0xFFFF == 0:  # a byte-swapped small number
        raise UnsupportedModel(f"{path}: a big-endian GGUF (version {int.from_bytes(_U32.pack(version), 'big')}); "
                               "only little-endian GGUF files load")
    if version not in SUPPORTED_VERSIONS:
        raise UnsupportedModel(f"{path}: GGUF version {version} is not supported (versions "
                               f"{', '.join(map(str, SUPPORTED_VERSIONS))})")


def _read_fields(cursor: _Cursor, count: int) -> dict[str, object]:
    _check_count(cursor, count, 8 + 4 + 1, "metadata key/value count")  # key length, value type, a u8
    fields: dict[str, object] = {}
    for index in range(count):
        cursor.what = f"metadata key/value {index} of {count}"
        try:
            key = cursor.string()
            cursor.what = f"metadata key {key!r}"
            (value_type,) = cursor.unpack(_U32)
            if key == "general.alignment" and value_type != _UINT32:
                raise cursor.error(f"has value type {value_type}, not uint32 ({_UINT32})")
            value = cursor.value(value_type)
        except UnicodeDecodeError as e:
            raise cursor.error(f"holds a string that is not UTF-8 ({e.reason} at byte {e.start})") from None
        if key in fields:
            raise cursor.error("appears twice")
        fields[key] = value
    return fields


def _read_tensor_infos(cursor: _Cursor, count: int) -> list[tuple[str, tuple[int, ...], int, int]]:
    _check_count(cursor, count, 8 + 4 + 4 + 8, "tensor count")  # name length, dims count, type, offset
    infos = []
    names: set[str] = set()
    for index in range(count):
        cursor.what = f"tensor info {index} of {count}"
        try:
            name = cursor.string()
        except UnicodeDecodeError as e:
            raise cursor.error(f"has a name that is not UTF-8 ({e.reason} at byte {e.start})") from None
        cursor.what = f"tensor info {name!r}"
        (num_dims,) = cursor.unpack(_U32)
        start = cursor.take(8 * num_dims)
        dims = struct.unpack_from(f"<{num_dims}Q", cursor.buf, start)
        raw_type, offset = cursor.unpack(_TENSOR_TYPE_OFFSET)
        if name in names:
            raise cursor.error("appears twice")
        names.add(name)
        infos.append((name, dims, raw_type, offset))
    return infos


def _check_count(cursor: _Cursor, count: int, min_size: int, name: str) -> None:
    if count * min_size > cursor.left():
        raise ValueError(f"{cursor.path}: the {name} {count} needs more than the {cursor.left()} bytes "
                         "left in the file: the file is truncated or corrupt")


def _alignment(path: Path, fields: dict[str, object]) -> int:
    alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"{path}: general.alignment {alignment!r} is not a power of two")
    return alignment


def _tensor(path: Path, mapped: np.memmap, data_offset: int, name: str, dims: tuple[int, ...], raw_type: int,
            offset: int) -> GGUFTensor:
    try:
        tensor_type = GGMLQuantizationType(raw_type)
    except ValueError:
        raise UnsupportedModel(f"{path}: tensor {name!r} has unknown GGML type {raw_type}") from None
    block_size, type_size = GGML_QUANT_SIZES[tensor_type]
    n_elements = math.prod(dims)
    n_bytes = n_elements * type_size // block_size
    start = data_offset + offset
    if start + n_bytes > mapped.size:
        raise ValueError(f"{path}: tensor {name!r} ({tensor_type.name}, {n_bytes} bytes at offset {start}) runs past "
                         f"the end of the file ({mapped.size} bytes): the file is truncated or corrupt")
    shape = tuple(reversed(dims))  # numpy order: outermost first
    dtype = _ELEMENT_DTYPES.get(tensor_type)
    if dtype is None:  # a block type: raw bytes per row, as gguf.quants.dequantize takes them
        if not shape or shape[-1] % block_size:
            raise ValueError(f"{path}: tensor {name!r} of shape {shape} is not rows of whole {tensor_type.name} "
                             f"blocks of {block_size}")
        dtype, shape = np.dtype(np.uint8), (*shape[:-1], shape[-1] // block_size * type_size)
    data = mapped[start:start + n_bytes].view(dtype).reshape(shape)
    return GGUFTensor(name, tensor_type, dims, n_elements, n_bytes, start, data)
