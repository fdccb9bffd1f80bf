"""`gguf_file.read_gguf` reads what gguf-py's `GGUFReader` reads, value for value and byte for byte, and
refuses malformed files with an error naming the file and the problem."""

from __future__ import annotations

import gc
import os
import struct
from collections.abc import Sequence
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize, quantize

import l4m.executor.gguf_file as gguf_file
from l4m.executor.architectures import UnsupportedModel
from l4m.executor.gguf_file import read_gguf
from l4m.executor.quant import from_gguf_blocks
from l4m.executor.weights import default_model_path, load_model

RNG = np.random.default_rng(0)
WEIGHTS = {  # name -> (type, float32 values); dims are whole Q4_1 / Q8_0 blocks of 32
    "f32.weight": (GGMLQuantizationType.F32, RNG.standard_normal((3, 2, 5)).astype(np.float32)),
    "f16.weight": (GGMLQuantizationType.F16, RNG.standard_normal((4, 6)).astype(np.float32)),
    "q4_1.weight": (GGMLQuantizationType.Q4_1, RNG.standard_normal((3, 64)).astype(np.float32)),
    "q8_0.weight": (GGMLQuantizationType.Q8_0, RNG.standard_normal((2, 96)).astype(np.float32)),
    "bf16.weight": (GGMLQuantizationType.BF16, RNG.standard_normal((2, 3)).astype(np.float32)),  # uint8, as gguf-py
    "norm.weight": (GGMLQuantizationType.F32, RNG.standard_normal(7).astype(np.float32)),
}
# key -> (GGUF type, value, element type of an array); the values as read, float32 rounded.
METADATA: dict[str, tuple[GGUFValueType, object, GGUFValueType | None]] = {
    "t.uint8": (GGUFValueType.UINT8, 255, None),
    "t.int8": (GGUFValueType.INT8, -128, None),
    "t.uint16": (GGUFValueType.UINT16, 65535, None),
    "t.int16": (GGUFValueType.INT16, -32768, None),
    "t.uint32": (GGUFValueType.UINT32, 2**32 - 1, None),
    "t.int32": (GGUFValueType.INT32, -(2**31), None),
    "t.uint64": (GGUFValueType.UINT64, 2**64 - 1, None),
    "t.int64": (GGUFValueType.INT64, -(2**63), None),
    "t.float32": (GGUFValueType.FLOAT32, float(np.float32(1e-5)), None),
    "t.float64": (GGUFValueType.FLOAT64, 1e-300, None),
    "t.true": (GGUFValueType.BOOL, True, None),
    "t.false": (GGUFValueType.BOOL, False, None),
    "t.string": (GGUFValueType.STRING, "héllo <|im_end|>\n", None),
    "t.empty_string": (GGUFValueType.STRING, "", None),
    "t.uint8s": (GGUFValueType.ARRAY, [0, 7, 255], GGUFValueType.UINT8),
    "t.int32s": (GGUFValueType.ARRAY, [-1, 0, 2**31 - 1], GGUFValueType.INT32),
    "t.uint64s": (GGUFValueType.ARRAY, [2**64 - 1, 1], GGUFValueType.UINT64),
    "t.float32s": (GGUFValueType.ARRAY, [0.5, -2.25], GGUFValueType.FLOAT32),
    "t.float64s": (GGUFValueType.ARRAY, [1e-300, 3.0], GGUFValueType.FLOAT64),
    "t.bools": (GGUFValueType.ARRAY, [True, False, True], GGUFValueType.BOOL),
    "t.strings": (GGUFValueType.ARRAY, ["a", "", "Ġthe", "日本"], GGUFValueType.STRING),
}
NESTED = [[1, 2], [3], [4, 5, 6]]  # an array of int32 arrays, which gguf-py's reader flattens


def _write(path: Path, alignment: int | None = None) -> None:
    writer = gguf.GGUFWriter(path, "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for key, (value_type, value, item_type) in METADATA.items():
        writer.add_key_value(key, value, value_type, sub_type=item_type)
    writer.add_array("t.nested", NESTED)
    for name, (kind, values) in WEIGHTS.items():
        if kind == GGMLQuantizationType.F32:
            writer.add_tensor(name, values)
        elif kind == GGMLQuantizationType.F16:
            writer.add_tensor(name, values.astype(np.float16))
        else:
            writer.add_tensor(name, quantize(values, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _assert_tensors_match_gguf_py(ours: list[gguf_file.GGUFTensor], theirs: list) -> None:
    assert [t.name for t in ours] == [t.name for t in theirs]
    for mine, reference in zip(ours, theirs, strict=True):
        assert mine.tensor_type == reference.tensor_type, mine.name
        assert mine.shape == tuple(int(d) for d in reference.shape), mine.name
        assert (mine.n_elements, mine.n_bytes, mine.data_offset) == (
            reference.n_elements, reference.n_bytes, reference.data_offset), mine.name
        assert (mine.data.dtype, mine.data.shape) == (reference.data.dtype, reference.data.shape), mine.name
        assert mine.data.tobytes() == reference.data.tobytes(), mine.name


def test_the_default_model_reads_as_gguf_py_reads_it() -> None:
    path = default_model_path()
    ours, theirs = read_gguf(path), gguf.GGUFReader(path)
    reference = {key: f.contents() for key, f in theirs.fields.items() if not key.startswith("GGUF.")}
    assert ours.fields == reference
    assert {key: type(value) for key, value in ours.fields.items()} == {
        key: type(value) for key, value in reference.items()}
    assert all(type(token) is str for token in ours.fields["tokenizer.ggml.tokens"])
    assert len(ours.fields["tokenizer.ggml.tokens"]) == 49152
    assert ours.version == int(theirs.fields["GGUF.version"].contents()) == 3
    assert len(ours.tensors) == int(theirs.fields["GGUF.tensor_count"].contents())
    assert ours.data_offset == theirs.data_offset
    _assert_tensors_match_gguf_py(ours.tensors, theirs.tensors)


# A first read of 16 bytes makes every string, array and tensor info cross the end of what was read.
@pytest.mark.parametrize("first_read", [gguf_file.FIRST_READ_BYTES, 16])
@pytest.mark.parametrize("alignment", [None, 128])
def test_every_value_type_and_tensor_type(tmp_path: Path, monkeypatch, first_read: int, alignment: int | None) -> None:
    monkeypatch.setattr(gguf_file, "FIRST_READ_BYTES", first_read)
    path = tmp_path / "all.gguf"
    _write(path, alignment)
    ours, theirs = read_gguf(path), gguf.GGUFReader(path)

    expected = {key: value for key, (_, value, _) in METADATA.items()}
    assert {key: ours.fields[key] for key in expected} == expected
    assert {key: type(ours.fields[key]) for key in expected} == {key: type(value) for key, value in expected.items()}
    assert ours.fields["t.nested"] == NESTED
    assert ours.fields["general.architecture"] == "llama"
    assert {k: v for k, v in ours.fields.items() if k != "t.nested"} == {
        k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.") and k != "t.nested"}
    assert ours.alignment == (alignment or 32) == ours.fields.get("general.alignment", 32)
    assert all(t.data_offset % ours.alignment == 0 for t in ours.tensors)
    _assert_tensors_match_gguf_py(ours.tensors, theirs.tensors)

    for tensor in ours.tensors:
        kind, values = WEIGHTS[tensor.name]
        assert tensor.shape == tuple(reversed(values.shape))  # ggml order: innermost first
        restored = dequantize(tensor.data, tensor.tensor_type).reshape(values.shape)
        if kind in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            assert tensor.data.dtype == (np.float32 if kind == GGMLQuantizationType.F32 else np.float16)
            np.testing.assert_array_equal(restored, values.astype(tensor.data.dtype))
        else:
            block_size, type_size = gguf.GGML_QUANT_SIZES[kind]
            assert tensor.data.dtype == np.uint8
            assert tensor.data.shape == (values.shape[0], values.shape[1] // block_size * type_size)
            np.testing.assert_array_equal(restored, dequantize(quantize(values, kind), kind))
        if kind in (GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0):
            blocks = from_gguf_blocks(kind.name.lower(), tensor.data, values.shape[0])
            assert blocks.d.shape == (values.shape[0], values.shape[1] // 32)


def _string(text: str | bytes) -> bytes:
    data = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(data)) + data


def _kv(key: str | bytes, value_type: int, payload: bytes) -> bytes:
    return _string(key) + struct.pack("<I", value_type) + payload


def _raw(path: Path, kvs: Sequence[bytes] = (), infos: Sequence[bytes] = (), version: int = 3, magic: bytes = b"GGUF",
         tail: bytes = b"", counts: tuple[int, int] | None = None) -> Path:
    """A GGUF written byte by byte: header, `kvs`, `infos`, then `tail` (padding and tensor data)."""
    tensor_count, kv_count = counts or (len(infos), len(kvs))
    path.write_bytes(struct.pack("<4sIQQ", magic, version, tensor_count, kv_count) + b"".join(kvs)
                     + b"".join(infos) + tail)
    return path


def _info(name: str, dims: tuple[int, ...], kind: int, offset: int = 0) -> bytes:
    return _string(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, kind, offset)


@pytest.mark.parametrize("version", [2, 3])
def test_hand_written_files_of_both_versions_with_empty_arrays(tmp_path: Path, version: int) -> None:
    kvs = [_kv("empty.u32", 9, struct.pack("<IQ", 4, 0)), _kv("empty.strings", 9, struct.pack("<IQ", 8, 0)),
           _kv("nested.strings", 9, struct.pack("<IQ", 9, 2) + struct.pack("<IQ", 8, 1) + _string("x")
               + struct.pack("<IQ", 8, 0))]
    path = _raw(tmp_path / "v.gguf", kvs, [_info("w", (2,), 0)], version=version)
    header_size = path.stat().st_size
    path.write_bytes(path.read_bytes() + b"\0" * (-header_size % 32) + struct.pack("<2f", 1.5, -2.0))
    ours = read_gguf(path)
    assert ours.version == version
    assert ours.fields == {"empty.u32": [], "empty.strings": [], "nested.strings": [["x"], []]}
    assert [gguf.GGUFReader(path).fields[k].contents() for k in ("empty.u32", "empty.strings")] == [[], []]
    np.testing.assert_array_equal(ours.tensors[0].data, np.array([1.5, -2.0], dtype=np.float32))
    assert ours.tensors[0].data_offset == ours.data_offset == path.stat().st_size - 8


def _written(tmp_path: Path) -> tuple[Path, bytes, gguf.GGUFReader]:
    path = tmp_path / "good.gguf"
    _write(path)
    return path, path.read_bytes(), gguf.GGUFReader(path)


def _truncations(tmp_path: Path) -> dict[str, tuple[int, str]]:
    """Where to cut the file written by `_write`, and the words the error must hold."""
    _, data, reference = _written(tmp_path)
    last_key = reference.fields["t.nested"].offset
    last = reference.tensors[-1]
    return {
        "in the header": (20, "not a GGUF file"),
        "in a key": (last_key + 9, "metadata key/value 22 of 23 runs past the end of the file"),
        # Cuts late enough that the counts still fit in what is left, so the loops themselves find the end.
        "in an array of strings": (last_key - 2, "metadata key 't.strings' runs past the end of the file"),
        "in the tensor infos": (last.field.offset + 10, "tensor info 5 of 6 runs past the end of the file"),
        "in a tensor's dims": (last.field.offset + 27, "tensor info 'norm.weight' runs past the end"),
        "in the tensor data": (last.data_offset + 5, f"tensor {last.name!r} (F32, 28 bytes at offset "
                                                     f"{last.data_offset}) runs past the end of the file"),
    }


@pytest.mark.parametrize("where", ["in the header", "in a key", "in an array of strings", "in the tensor infos",
                                   "in a tensor's dims", "in the tensor data"])
def test_a_truncated_file_is_refused_naming_the_file_and_the_part(tmp_path: Path, where: str) -> None:
    cut, words = _truncations(tmp_path)[where]
    path = tmp_path / "cut.gguf"
    path.write_bytes((tmp_path / "good.gguf").read_bytes()[:cut])
    with pytest.raises(ValueError) as error:
        read_gguf(path)
    assert str(error.value).startswith(f"{path}: ") and words in str(error.value)


def test_every_cut_of_a_file_is_refused_with_a_value_error(tmp_path: Path) -> None:
    """Cut after each of 200 spread byte counts: a clear ValueError, never another exception or a hang."""
    path, data, reference = _written(tmp_path)
    end = reference.tensors[-1].data_offset + reference.tensors[-1].n_bytes  # GGUFWriter pads after it
    cut_path = tmp_path / "cut.gguf"
    for cut in sorted(set(np.linspace(0, end - 1, 200, dtype=int).tolist())):
        cut_path.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=f"^{cut_path}: "):
            read_gguf(cut_path)


BAD_FILES = {
    "bad magic": (dict(magic=b"GGML"), ValueError, "not a GGUF file (magic b'GGML', expected b'GGUF')"),
    "version 1": (dict(version=1), UnsupportedModel, "GGUF version 1 is not supported (versions 2, 3)"),
    "version 4": (dict(version=4), UnsupportedModel, "GGUF version 4 is not supported"),
    "big-endian": (dict(version=0x03000000), UnsupportedModel, "a big-endian GGUF (version 3)"),
    "a corrupt key count": (dict(counts=(0, 2**62)), ValueError, "metadata key/value count 4611686018427387904 needs"),
    "a corrupt tensor count": (dict(counts=(2**40, 0)), ValueError, "tensor count 1099511627776 needs more than"),
    "a corrupt array count": (dict(kvs=[_kv("a", 9, struct.pack("<IQ", 8, 2**61))]), ValueError,
                              "metadata key 'a' holds 2305843009213693952 items, more than"),
    "an unknown value type": (dict(kvs=[_kv("a", 13, b"\0" * 8)]), ValueError, "key 'a' has unknown value type 13"),
    "an unknown array type": (dict(kvs=[_kv("a", 9, struct.pack("<IQ", 20, 1))]), ValueError,
                              "key 'a' is an array of unknown value type 20"),
    "a key not UTF-8": (dict(kvs=[_kv(b"\xff", 0, b"\0")]), ValueError, "0 of 1 holds a string that is not UTF-8"),
    "a string not UTF-8": (dict(kvs=[_kv("s", 8, _string(b"\xc3"))]), ValueError, "key 's' holds a string that is not"),
    "a duplicate key": (dict(kvs=[_kv("a", 0, b"\1"), _kv("a", 0, b"\2")]), ValueError, "key 'a' appears twice"),
    "an alignment not uint32": (dict(kvs=[_kv("general.alignment", 10, struct.pack("<Q", 32))]), ValueError,
                                "key 'general.alignment' has value type 10, not uint32"),
    "an alignment not a power of two": (dict(kvs=[_kv("general.alignment", 4, struct.pack("<I", 48))]), ValueError,
                                        "general.alignment 48 is not a power of two"),
    "a zero alignment": (dict(kvs=[_kv("general.alignment", 4, struct.pack("<I", 0))]), ValueError,
                         "general.alignment 0 is not a power of two"),
    "arrays nested too deep": (dict(kvs=[_kv("n", 9, struct.pack("<IQ", 9, 1) * 9 + struct.pack("<IQ", 4, 0))]),
                               ValueError, "key 'n' nests arrays deeper than 8"),
    "a duplicate tensor": (dict(infos=[_info("w", (1,), 0), _info("w", (1,), 0, 32)], tail=b"\0" * 64), ValueError,
                           "tensor info 'w' appears twice"),
    "an unknown tensor type": (dict(infos=[_info("w", (32,), 99)], tail=b"\0" * 64), UnsupportedModel,
                               "tensor 'w' has unknown GGML type 99"),
    "rows not whole blocks": (dict(infos=[_info("w", (33,), 8)], tail=b"\0" * 64), ValueError,
                              "tensor 'w' of shape (33,) is not rows of whole Q8_0 blocks of 32"),
    "a tensor past the end": (dict(infos=[_info("w", (4,), 0, 64)], tail=b"\0" * 64), ValueError,
                              "tensor 'w' (F32, 16 bytes at offset 128) runs past the end of the file (121 bytes)"),
}


@pytest.mark.parametrize("bad", list(BAD_FILES))
def test_a_malformed_file_is_refused_naming_the_file_and_what_is_wrong(tmp_path: Path, bad: str) -> None:
    layout, error_type, words = BAD_FILES[bad]
    path = _raw(tmp_path / "bad.gguf", **layout)
    with pytest.raises(error_type) as error:
        read_gguf(path)
    assert str(error.value).startswith(f"{path}: ") and words in str(error.value)


def test_an_empty_file_and_the_loader_name_the_file(tmp_path: Path) -> None:
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=f"^{empty}: not a GGUF file \\(0 bytes"):
        read_gguf(empty)
    bad = _raw(tmp_path / "bad.gguf", magic=b"GGML")
    with pytest.raises(ValueError, match=f"^{bad}: not a GGUF file"):
        load_model(bad)


def test_refused_files_leave_no_file_open(tmp_path: Path) -> None:
    """Each refusal affects only its own file and closes it (Linux: /proc/self/fd)."""
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("no /proc/self/fd to count open files")
    path, data, reference = _written(tmp_path)
    end = reference.tensors[-1].data_offset + reference.tensors[-1].n_bytes
    del reference
    read_gguf(path)  # warm imports
    gc.collect()
    open_before = len(os.listdir("/proc/self/fd"))
    for index, (layout, error_type, _) in enumerate(BAD_FILES.values()):
        with pytest.raises(error_type):
            read_gguf(_raw(tmp_path / f"bad{index}.gguf", **layout))
        cut = tmp_path / f"cut{index}.gguf"
        cut.write_bytes(data[:end - 1 - index])
        with pytest.raises(ValueError):
            read_gguf(cut)
    good = read_gguf(path)
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) == open_before + 1  # the good file's mapping alone
    del good
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) == open_before
