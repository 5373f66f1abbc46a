"""Tiny random-weight checkpoints for CPU tests (Hugging Face directories and GGUF files).

``make_tiny_hf_checkpoint(dir, family)`` writes a ``transformers`` model (hidden 64, 4 heads,
2 kv heads) with a small byte-level BPE ``tokenizer.json`` and a ChatML chat template;
``make_tiny_gguf(path, hf_dir)`` converts such a directory into a GGUF file the way
llama.cpp's converter does (Q/K rows permuted for ``llama``), optionally quantized.

Usable from any test: ``from tests.tiny_checkpoints import make_tiny_hf_checkpoint``.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

FAMILIES = ("llama", "llama3", "qwen2", "qwen3")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% if bos_token %}{{ bos_token }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun.",
    "Streaming inference keeps the key value cache alive between questions and answers.",
    "Paris is the capital of France; Berlin is the capital of Germany. 1234567890",
    "def add(a, b):\n    return a + b  # simple function\n",
    "Hello, world! How are you today? I am fine, thank you very much.",
    "Les élèves étudient à l'école. 日本語のテキスト. Ünïcödé 😀 emoji.",
] * 20
TINY_VOCAB = 384
# make_tiny_gguf's quantization for every linear: a GGUF like the embedded model's (Q4_1 layers)
Q4_LINEARS = {kind: "Q4_1" for kind in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                                         "ffn_down")}

_BASE: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=TINY_VOCAB, max_position_embeddings=256,
    rms_norm_eps=1e-5, initializer_range=0.1, bos_token_id=0, eos_token_id=2,
)
_FAMILY: dict[str, dict[str, Any]] = {
    "llama": dict(rope_theta=10000.0, tie_word_embeddings=False),
    "llama3": dict(rope_theta=500000.0, tie_word_embeddings=True, max_position_embeddings=512,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen2": dict(rope_theta=1000000.0, tie_word_embeddings=True),
    "qwen3": dict(rope_theta=1000000.0, tie_word_embeddings=False, head_dim=16),
}


def _config(family: str, overrides: Mapping[str, Any]) -> Any:
    """A ``transformers`` config for ``family`` with ``overrides`` applied."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose from {FAMILIES}")
    cls = {"llama": LlamaConfig, "llama3": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[family]
    return cls(**{**_BASE, **_FAMILY[family], **overrides})


def _randomize_small_params(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Give norms and biases non-trivial values so parity tests exercise them."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=generator))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))


# Pre-tokenizer split regexes of the real families (None: GPT-2's built into ByteLevel).
_SPLIT_REGEX: dict[str, str | None] = {
    "llama": None,
    "llama3": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
    "qwen2": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
}
_SPLIT_REGEX["qwen3"] = _SPLIT_REGEX["qwen2"]
#: ``tokenizer.ggml.pre`` value matching each family's pre-tokenizer.
GGUF_PRE = {"llama": "default", "llama3": "llama-bpe", "qwen2": "qwen2", "qwen3": "qwen2"}


def build_tiny_tokenizer(family: str = "llama", add_bos: bool = False) -> Any:
    """A small byte-level BPE ``tokenizers.Tokenizer`` trained on a fixed corpus.

    The pre-tokenizer is the one the real ``family`` uses (GPT-2, Llama-3 or Qwen2 regex).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    regex = _SPLIT_REGEX[family]
    if regex is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_VOCAB - 16, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{SPECIAL_TOKENS[0]} $A", pair=f"{SPECIAL_TOKENS[0]} $A {SPECIAL_TOKENS[0]} $B",
            special_tokens=[(SPECIAL_TOKENS[0], 0)])
    return tok


def _write_tokenizer(directory: Path, family: str) -> None:
    """tokenizer.json + tokenizer_config.json (with chat template) for ``family``."""
    add_bos = family.startswith("llama")
    build_tiny_tokenizer(family, add_bos=add_bos).save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[0] if add_bos else None,
        "eos_token": SPECIAL_TOKENS[2],
        "pad_token": SPECIAL_TOKENS[0],
        "unk_token": None,
        "add_bos_token": add_bos,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 256,
        "added_tokens_decoder": {str(i): {"content": t, "special": True, "normalized": False,
                                          "lstrip": False, "rstrip": False, "single_word": False}
                                 for i, t in enumerate(SPECIAL_TOKENS)},
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")


def make_tiny_hf_checkpoint(dir: Path, family: str, *, seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny random-weight Hugging Face checkpoint of ``family`` into ``dir``.

    ``family`` is ``"llama"``, ``"llama3"`` (Llama-3 RoPE scaling), ``"qwen2"`` (q/k/v
    bias) or ``"qwen3"`` (qk-norm). ``overrides`` are passed to the ``transformers`` config
    (e.g. ``num_hidden_layers=4``, ``tie_word_embeddings=True``); ``max_shard_size`` is
    passed to ``save_pretrained`` instead. Weights are deterministic for a given ``seed``.
    Returns ``dir``.
    """
    from transformers import AutoModelForCausalLM

    directory = Path(dir)
    directory.mkdir(parents=True, exist_ok=True)
    shard_size = overrides.pop("max_shard_size", "50GB")
    config = _config(family, overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        _randomize_small_params(model, torch.Generator().manual_seed(seed + 1))
    model.eval()
    if family == "llama3":
        model.generation_config.eos_token_id = [2, 0]
    model.save_pretrained(directory, max_shard_size=shard_size)
    _write_tokenizer(directory, family)
    return directory


# --------------------------------------------------------------------------- GGUF writer

_GGUF_ARCH = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
_HF_TO_GGUF = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    """llama.cpp tensor name of a Hugging Face parameter name."""
    name = hf_name.removeprefix("model.")
    top = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if name in top:
        return top[name]
    _, index, rest = name.split(".", 2)
    part, kind = rest.rsplit(".", 1)
    return f"blk.{index}.{_HF_TO_GGUF[part]}.{kind}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` (HF rotate-half rows -> interleaved rows)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _add_tokenizer_metadata(writer: Any, hf_dir: Path, pre: str, add_bos: bool) -> None:
    """``tokenizer.ggml.*`` keys from the directory's byte-level BPE tokenizer.json."""
    spec = json.loads((hf_dir / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = spec["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(CHAT_TEMPLATE)


def make_tiny_gguf(path: Path, hf_dir: Path, tensor_types: Mapping[str, str] | None = None,
                   pre: str = "default") -> Path:
    """Convert a tiny HF checkpoint directory into a GGUF file at ``path``.

    ``tensor_types`` maps a GGUF tensor kind (``"attn_q"``, ``"token_embd"``, ``"ffn_down"``...)
    to a GGML type name (``"Q8_0"``, ``"Q4_0"``, ``"Q4_1"``, ``"F16"``, ``"BF16"``); everything
    else is stored as F32. Q/K rows are permuted for llama, and Llama-3 RoPE scaling is
    stored as a ``rope_freqs`` tensor, as llama.cpp's converter does. ``pre`` is the
    ``tokenizer.ggml.pre`` value (see :data:`GGUF_PRE`).
    """
    import gguf
    from safetensors.torch import load_file

    config = json.loads((hf_dir / "config.json").read_text(encoding="utf-8"))
    arch = _GGUF_ARCH[config["architectures"][0]]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config.get("rope_parameters", {}).get("rope_theta", 10000.0))
    _add_tokenizer_metadata(writer, hf_dir, pre, add_bos=arch == "llama")
    state = load_file(str(hf_dir / "model.safetensors"))
    for hf_name, tensor in state.items():
        name = gguf_name(hf_name)
        data = tensor.float().numpy()
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            data = llama_cpp_permute(data, heads if ".attn_q." in name else kv_heads)
        qtype = (tensor_types or {}).get(name.split(".")[-2], "F32") if data.ndim == 2 else "F32"
        _add_tensor(writer, name, data, qtype)
    scaling = config.get("rope_parameters") or {}
    if scaling.get("rope_type") == "llama3":
        writer.add_rope_dimension_count(head_dim)
        writer.add_tensor("rope_freqs.weight", llama3_rope_freqs(scaling, head_dim))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def llama3_rope_freqs(scaling: Mapping[str, Any], head_dim: int) -> np.ndarray:
    """llama.cpp's ``rope_freqs`` tensor (per-frequency divisors) for Llama-3 scaling."""
    import math

    theta, factor = scaling["rope_theta"], scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def _add_tensor(writer: Any, name: str, data: np.ndarray, qtype: str) -> None:
    """Add one tensor, quantized to ``qtype`` with ``gguf.quants``."""
    import gguf
    from gguf.quants import quantize

    if qtype == "F32":
        writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
    elif qtype == "F16":
        writer.add_tensor(name, data.astype(np.float16))
    else:
        ggml_type = gguf.GGMLQuantizationType[qtype]
        writer.add_tensor(name, quantize(data, ggml_type), raw_dtype=ggml_type)


def sentencepiece_vocab(size: int = 120) -> tuple[list[str], list[float], list[int]]:
    """A small SentencePiece-style BPE vocabulary: ``(tokens, scores, token_types)``.

    ``<unk>``, ``<s>``, ``</s>``, the 256 ``<0xNN>`` byte-fallback tokens, then pieces
    (``▁`` marks a space) learned on a fixed corpus, scored by merge order as llama.cpp
    expects.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.train_from_iterator(_CORPUS, trainer=trainers.BpeTrainer(vocab_size=size, show_progress=False))
    pieces = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    return tokens, scores, types


def make_tiny_spm_gguf(path: Path, hf_dir: Path) -> Path:
    """A llama GGUF of ``hf_dir``'s weights with a SentencePiece (``llama``) tokenizer."""
    import gguf

    tokens, scores, types = sentencepiece_vocab()
    reader_free = make_tiny_gguf(Path(str(path) + ".tmp"), hf_dir)
    src = gguf.GGUFReader(str(reader_free))
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, field in src.fields.items():
        if key.startswith(("GGUF.", "general.architecture", "tokenizer.")):
            continue
        value = field.contents()
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, value)
        else:
            writer.add_key_value(key, value, vtype)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_chat_template(CHAT_TEMPLATE)
    for tensor in src.tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    Path(str(path) + ".tmp").unlink()
    return Path(path)
