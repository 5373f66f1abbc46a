"""The direct GGUF reader equals gguf-py's ``GGUFReader``: metadata, tensor data and decoded bits."""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from streamkv.errors import ModelLoadError
from streamkv.loading import default_model_path, gguf_decode
from streamkv.loading.gguf_file import GGUFFile
from streamkv.loading.gguf_parse import GGUFFormatError, parse_gguf
from tests.tiny_checkpoints import make_tiny_gguf, make_tiny_hf_checkpoint

QTYPES = {"token_embd": "Q8_0", "attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "F16",
          "attn_output": "BF16", "ffn_gate": "Q5_0", "ffn_up": "Q5_1"}


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gguf")
    return make_tiny_gguf(root / "tiny.gguf", make_tiny_hf_checkpoint(root / "hf", "llama"), QTYPES)


def _same_as_gguf_py(path: str) -> None:
    """Every metadata value and tensor view of ``path`` equals gguf-py's reading."""
    import gguf

    reader = gguf.GGUFReader(path)
    parsed = parse_gguf(path)
    expected = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert list(parsed.metadata) == list(expected)
    for key, value in expected.items():
        assert parsed.metadata[key] == value, key
        assert type(parsed.metadata[key]) is type(value), key
    assert [t.name for t in parsed.tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(parsed.tensors, reader.tensors):
        assert ours.type_id == theirs.tensor_type and ours.dims == tuple(int(d) for d in theirs.shape)
        assert ours.data.dtype == theirs.data.dtype and ours.data.shape == theirs.data.shape
        assert np.array_equal(ours.data.view(np.uint8), np.asarray(theirs.data).view(np.uint8))
        assert not ours.data.flags.writeable


def test_tiny_gguf_reads_like_gguf_py(tiny_gguf: Path) -> None:
    _same_as_gguf_py(str(tiny_gguf))


def test_embedded_model_reads_like_gguf_py() -> None:
    _same_as_gguf_py(default_model_path())


@pytest.mark.parametrize("decoder", ["native", "torch"])
@pytest.mark.parametrize("source", ["tiny", "embedded"])
def test_dequantized_bits_equal_gguf_py(source: str, decoder: str, tiny_gguf: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Both decoders (the native pass; torch where the kernels are off) give
    gguf.quants.dequantize's exact float32 values, every type."""
    from gguf.quants import dequantize

    if decoder == "torch":
        monkeypatch.setattr(gguf_decode, "gguf_dequant", lambda: None)
    elif gguf_decode.gguf_dequant() is None:
        pytest.skip("the native kernels are unavailable here (no C compiler, or STREAMKV_NATIVE=0)")
    gguf_file = GGUFFile(str(tiny_gguf) if source == "tiny" else default_model_path())
    types = set()
    for tensor in gguf_file.tensors():
        expected = np.asarray(dequantize(tensor.raw, tensor.type_id), np.float32).reshape(tensor.shape)
        ours = gguf_file.dequantize(tensor)
        assert ours.dtype == np.float32 and ours.flags.writeable
        assert np.array_equal(ours.view(np.uint32), expected.view(np.uint32)), tensor.name
        types.add(tensor.type_name)
    assert types >= ({"F32", *QTYPES.values()} if source == "tiny" else {"F32", "Q4_1", "Q8_0"})


@pytest.mark.parametrize("kind", sorted(gguf_decode.BLOCK_BYTES))
def test_the_native_block_decoder_gives_the_torch_decoders_bits_for_any_bytes(kind: str) -> None:
    """Random blocks: every f16 scale (subnormal, infinite and NaN ones included), every nibble."""
    if gguf_decode.gguf_dequant() is None:
        pytest.skip("the native kernels are unavailable here (no C compiler, or STREAMKV_NATIVE=0)")
    raw = np.random.default_rng(7).integers(0, 256, size=(5000, gguf_decode.BLOCK_BYTES[kind]), dtype=np.uint8)
    raw[:64, 1] &= 0x83  # scales with a zero exponent: subnormal halves (and zeros)
    ours, torch_bits = gguf_decode.dequantize(raw, kind), gguf_decode._decode_blocks(raw, kind)
    nan = np.isnan(torch_bits)
    assert np.array_equal(np.isnan(ours), nan)
    assert np.array_equal(ours.view(np.uint32)[~nan], torch_bits.view(np.uint32)[~nan])
    scales = np.abs(np.ascontiguousarray(raw[:64, :2]).view(np.float16).astype(np.float32))
    assert ((scales > 0) & (scales < 2 ** -14)).sum() > 32  # subnormal scales were decoded
    with pytest.raises(ValueError, match="whole"):
        gguf_decode.dequantize(raw.reshape(-1)[:-1], kind)


def _patch(data: bytes, offset: int, fmt: str, value: int) -> bytes:
    return data[:offset] + struct.pack(fmt, value) + data[offset + struct.calcsize(fmt):]


def test_layout_errors_are_typed(tiny_gguf: Path, tmp_path: Path) -> None:
    data = tiny_gguf.read_bytes()
    bad = tmp_path / "bad.gguf"
    cases = {
        "GGUF version 1": _patch(data, 4, "<I", 1),
        "unknown metadata value type": _patch(data, 24 + 8 + len("general.architecture"), "<I", 99),
        "larger than the file": _patch(data, 8, "<Q", 1 << 40),
        "unexpected end of file": data[:14],
        "string of .* bytes at byte .* runs past": data[:200],
        "the file is empty": b"",
    }
    for message, content in cases.items():
        bad.write_bytes(content)
        with pytest.raises(GGUFFormatError, match=message):
            parse_gguf(str(bad))
        with pytest.raises(ModelLoadError, match="corrupt or truncated"):
            GGUFFile(str(bad))
    bad.write_bytes(data[:-1])  # the last tensor's data is cut
    with pytest.raises(GGUFFormatError, match="runs past the end of the file"):
        parse_gguf(str(bad))


def test_a_cut_vocabulary_is_a_typed_error(tiny_gguf: Path, tmp_path: Path) -> None:
    """The string-array fast path (vocabulary, merges) checks every length and every string."""
    data = tiny_gguf.read_bytes()
    key = b"tokenizer.ggml.tokens"
    first = data.index(key) + len(key) + 4 + 4 + 8  # value type, element type, count
    (length,) = struct.unpack_from("<Q", data, first)
    bad = tmp_path / "cut.gguf"
    for cut, message in ((first + 3, "unexpected end of file"),
                         (first + 8 + length - 1, "string of .* bytes at byte .* runs past")):
        bad.write_bytes(data[:cut])
        with pytest.raises(GGUFFormatError, match=message):
            parse_gguf(str(bad))
