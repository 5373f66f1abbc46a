"""Frozen configuration dataclasses, one per subsystem, composed into EngineConfig.

The CLI is generated from these (see ``streamkv.cli``): every field with a ``help``
metadata entry becomes a ``--flag``.
"""
from __future__ import annotations

import math
import re

from dataclasses import dataclass, field
from typing import Any

DTYPES = ("auto", "float32", "bfloat16")
DECODE_WEIGHTS = ("auto", "dense", "q4")
MAX_THREADS = 4096  # well past any CPU's cores: 100,000 failed to start its threads, 1e20 overflowed a C long


def check_types(config: object) -> None:
    """ValueError for a field whose value is not of its annotated kind (``int``, ``float``,
    ``bool``, ``str``, each maybe ``| None``): Python callers (``LLM(...)``) pass values the CLI
    would have parsed, and ``"false"`` for a bool, 2.5 for a count or NaN must not get through
    (a float draft length broke every later step; ``"false"`` turned an option on)."""
    from dataclasses import fields

    for f in fields(config):  # type: ignore[arg-type]
        kind, _, none = str(f.type).partition(" | ")
        value = getattr(config, f.name)
        if value is None and none == "None":
            continue
        ok = {"int": lambda v: isinstance(v, int) and not isinstance(v, bool),
              "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v == v,
              "bool": lambda v: isinstance(v, bool),
              "str": lambda v: isinstance(v, str)}.get(kind)
        if ok is not None and not ok(value):
            what = {"int": "an integer", "float": "a number (not NaN)", "bool": "true or false", "str": "a string"}[kind]
            raise ValueError(f"{f.name} must be {what}{' or None' if none == 'None' else ''}, got {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = field(default=None, metadata={"unit": "PATH", "help": "GGUF file or Hugging Face directory "
                                                               "(default: embedded SmolLM2-135M-Instruct)"})
    dtype: str = field(default="auto", metadata={"help": "auto | float32 | bfloat16"})
    max_model_len: int | None = field(default=None, metadata={"unit": "TOKENS", "help": "context limit (default: the model's)"})
    decode_weights: str = field(default="auto", metadata={
        "help": "auto | dense | q4: small batches (decode) read the GGUF's own Q4_0/Q4_1 blocks through "
                "torch's int4 kernel; auto = q4 for such GGUFs in bfloat16 on CPU"})

    def __post_init__(self) -> None:
        check_types(self)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.decode_weights not in DECODE_WEIGHTS:
            raise ValueError(f"decode_weights must be one of {DECODE_WEIGHTS}, got {self.decode_weights!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = field(default=16, metadata={"unit": "TOKENS", "help": "tokens per KV block"})
    kv_cache_memory: int = field(default=1 << 30, metadata={"unit": "BYTES", "help": "bytes of KV cache (sets the pool size)"})
    num_blocks: int | None = field(default=None, metadata={"unit": "BLOCKS", "help": "explicit pool size in blocks "
                                                                    "(overrides --kv-cache-memory)"})
    enable_prefix_caching: bool = field(default=True, metadata={"help": "reuse KV of shared prefixes"})
    kv_cache_dtype: str = field(default="auto", metadata={
        "help": "auto | float32 | bfloat16; auto = the model dtype (a float32 cache for a bfloat16 model "
                "measured no faster on CPU and holds half the tokens)"})
    swap_space: int = field(default=0, metadata={"unit": "BYTES", 
        "help": "bytes of host memory a preempted sequence's KV can be swapped to instead of being "
                "recomputed (see --preemption); 0 = off"})
    span_host_bytes: int = field(default=1 << 30, metadata={"unit": "BYTES",
        "help": "bytes of host memory that cached span states move to when the pool needs their blocks "
                "(restored on their next hit instead of recomputed); 0 = drop them"})
    response_cache_entries: int = field(default=0, metadata={"unit": "ENTRIES", 
        "help": "LRU cache of full responses to deterministic stateless requests (temperature 0 or a "
                "seed), keyed by prompt ids and sampling parameters; 0 = off"})
    seed_from_prompt: bool = field(default=False, metadata={
        "help": "a sampled request without a seed gets seed = FNV-1a(prompt ids) (choice i of n: + i), so "
                "identical requests give identical outputs at any temperature and the response cache serves "
                "them; off by default: OpenAI clients expect variety without a seed. A request's seed wins"})

    def __post_init__(self) -> None:
        check_types(self)
        if self.kv_cache_dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"kv_cache_dtype must be auto, float32 or bfloat16, got {self.kv_cache_dtype!r}")
        if self.block_size < 1 or self.block_size > 1024:
            raise ValueError(f"block_size must be in [1, 1024], got {self.block_size}")
        if self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0, got {self.swap_space}")
        if self.span_host_bytes < 0:
            raise ValueError(f"span_host_bytes must be >= 0, got {self.span_host_bytes}")
        if self.response_cache_entries < 0:
            raise ValueError(f"response_cache_entries must be >= 0, got {self.response_cache_entries}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = field(default=64, metadata={"unit": "SEQUENCES", "help": "sequences per step"})
    max_num_batched_tokens: int = field(default=2048, metadata={"unit": "TOKENS", "help": "token budget per step"})
    max_chunk_tokens: int | None = field(default=None, metadata={"unit": "TOKENS", "help": "largest prefill chunk of one "
                                                                          "sequence per step (default: budget)"})
    queue_policy: str = field(default="fcfs", metadata={
        "help": "fifo | fcfs | mcps | lcas: order within a priority class; all but fifo rank requests whose "
                "input is complete above streaming-input requests still receiving it (two tiers: the lower "
                "tier's prefill never shares a step with the upper tier's); fcfs = "
                "arrival, mcps = most computed tokens first, lcas = most recent input chunk first"})
    preemption: str = field(default="cost", metadata={
        "help": "recompute | swap | cost: a preempted sequence drops its KV (recompute), moves it to the "
                "host swap space (swap, needs --swap-space), or whichever the measured cost profile says is "
                "cheaper (cost; `streamkv profile`)"})
    max_wait_s: float | None = field(default=None, metadata={"unit": "SECONDS", 
        "help": "aging bound: a complete request with work whose input arrived or last changed longer ago "
                "than this ranks first in its tier, oldest first (bounds LCAS starvation); default off"})

    admission: str = field(default="none", metadata={
        "help": "none | cell-budget: cell-budget admits a new request only while the admitted sequences' "
                "projected KV, sum of min(prompt + max_tokens, context), stays under --admission-ceiling x the "
                "pool (the rest stays for cached prefixes and sessions), and above --admission-high-water pool "
                "occupancy holds prompt chunks back step by step; requests wait, never fail"})
    admission_ceiling: float = field(default=0.5, metadata={"unit": "FRACTION", "help": "cell-budget: share of the pool"})
    admission_high_water: float = field(default=0.95, metadata={"unit": "FRACTION", "help": (
        "cell-budget: pool occupancy above which prompt chunks wait")})
    chunking: str = field(default="adaptive", metadata={
        "help": "adaptive | static: adaptive = with N sequences prefilling, each gets "
                "clamp(budget / N, --chunk-min-tokens, --chunk-max-tokens) rows this step (one long prompt "
                "big chunks, many prompts small ones, so decodes keep their cadence); static = up to the "
                "budget (or --max-chunk-tokens), first come first served"})
    chunk_min_tokens: int = field(default=128, metadata={"unit": "TOKENS", "help": "adaptive chunking's lower bound"})
    chunk_max_tokens: int = field(default=1024, metadata={"unit": "TOKENS", "help": "adaptive chunking's upper bound"})
    stall_factor: float | None = field(default=None, metadata={"unit": "FACTOR",
        "help": "decode cadence: while sequences decode or a question prefills, cap a step's "
                "prompt rows so the step is predicted to "
                "take at most this many decode-only steps (costs learned from step times); bounds the longest "
                "inter-token gap at the price of prefill throughput and TTFT; default off"})
    question_chunks: str = field(default="whole", metadata={
        "help": "whole | capped: a question's (session or flash) prompt rows under the decode cadence while "
                "sequences decode: whole = charged to the step's allowance but not cut by it (chunk and budget "
                "limits still apply; its answer sooner, every decoder waits for its prefill); capped = cut "
                "to the allowance like any prompt (the decoders keep their cadence; its first token a few "
                "steps later)"})
    grouped_prefill: bool = field(default=True, metadata={
        "help": "waiting requests whose prompts share full blocks past the prefix-cache match point with a "
                "prefilling request ranked above them (hash of the next 8 tokens, then verified) wait for it "
                "to compute those blocks and alias them as a prefix hit instead of computing them too "
                "(needs prefix caching; outputs unchanged)"})
    fork_gate: bool = field(default=True, metadata={
        "help": "a question's fork starts its own rows only when the free pool, less what the forks already "
                "started may still take to their ends, holds its own (the first always may); held forks "
                "wait at their fork point instead of taking blocks from one another mid-answer"})
    speculation: str = field(default="auto", metadata={
        "help": "auto | pld | none: prompt-lookup speculative decoding (drafts from the sequence's own earlier "
                "tokens, verified in one chunk; output identical to plain decoding; needs numerics=invariant); "
                "auto = pld with numerics=invariant, none with fast"})
    spec_max_draft: int = field(default=4, metadata={"unit": "TOKENS", "help": "most draft tokens per sequence and step"})
    spec_ngram_max: int = field(default=5, metadata={"unit": "TOKENS", "help": "longest n-gram looked up"})
    spec_ngram_min: int = field(default=2, metadata={"unit": "TOKENS", "help": "shortest n-gram looked up"})
    spec_draft_budget: int = field(default=6, metadata={"unit": "TOKENS", "help": (
        "draft tokens per step shared by the decoding sequences: each drafts at most "
        "budget / decoders (so none past budget decoders)")})
    spec_min_acceptance: float = field(default=0.3, metadata={"unit": "FRACTION", "help": (
        "a sequence whose running draft acceptance falls below this stops drafting (it probes now and then)")})

    def __post_init__(self) -> None:
        check_types(self)
        from streamkv.sched.policies import make_queue_policy

        from streamkv.sched.preemption import make_preemption

        make_queue_policy(self.queue_policy, self.max_wait_s)  # ValueError naming the problem
        make_preemption(self.preemption)
        self.make_speculator()
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_chunk_tokens is not None and self.max_chunk_tokens < 1:
            raise ValueError(f"max_chunk_tokens must be >= 1, got {self.max_chunk_tokens}")
        if self.admission not in ("none", "cell-budget"):
            raise ValueError(f"admission must be none or cell-budget, got {self.admission!r}")
        if not 0.0 < self.admission_ceiling <= 1.0 or not 0.0 < self.admission_high_water <= 1.0:
            raise ValueError(f"admission_ceiling and admission_high_water must be in (0, 1], got "
                             f"{self.admission_ceiling}, {self.admission_high_water}")
        if self.stall_factor is not None and not 1.0 < self.stall_factor < math.inf:  # (NaN fails too)
            raise ValueError(f"stall_factor must be a finite number > 1 (a step may take that many decode steps), got "
                             f"{self.stall_factor}")
        if self.question_chunks not in ("whole", "capped"):
            raise ValueError(f"question_chunks must be whole or capped, got {self.question_chunks!r}")
        if self.chunking not in ("adaptive", "static"):
            raise ValueError(f"chunking must be adaptive or static, got {self.chunking!r}")
        if not 1 <= self.chunk_min_tokens <= self.chunk_max_tokens:
            raise ValueError(f"need 1 <= chunk_min_tokens <= chunk_max_tokens, got {self.chunk_min_tokens}, "
                             f"{self.chunk_max_tokens}")

    @property
    def chunk_cap(self) -> int:
        return self.max_chunk_tokens or self.max_num_batched_tokens

    def chunk_for(self, num_prefilling: int) -> int:
        """Most prompt rows one sequence computes in a step where ``num_prefilling`` sequences
        have prompt rows pending (adaptive; none: the largest adaptive chunk, what the gauge
        shows between prompts, not the static cap above ``chunk_max_tokens``), or the static cap."""
        if self.chunking == "static":
            return self.chunk_cap
        share = self.max_num_batched_tokens // max(1, num_prefilling)
        return min(self.chunk_cap, max(self.chunk_min_tokens, min(self.chunk_max_tokens, share)))

    def make_speculator(self, numerics: str = "invariant") -> Any:
        """The speculation plug-in (None for ``none``, and for ``auto`` without invariant
        numerics); ValueError naming a bad setting."""
        from streamkv.sched.speculation import make_speculator

        name = self.speculation
        if name == "auto":
            name = "pld" if numerics == "invariant" else "none"
        return make_speculator(name, max_draft=self.spec_max_draft, ngram_max=self.spec_ngram_max,
                               ngram_min=self.spec_ngram_min, draft_budget=self.spec_draft_budget,
                               min_acceptance=self.spec_min_acceptance)


@dataclass(frozen=True)
class RuntimeConfig:
    threads: int | None = field(default=None, metadata={"unit": "THREADS", "help": "torch CPU threads (default: the cores this process may run on, its CPU affinity)"})
    device: str = field(default="cpu", metadata={"help": "cpu | cuda"})
    attention_backend: str = field(default="auto", metadata={
        "help": "auto | torch | cpu: cpu = native C kernels over the paged cache (built with gcc on "
                "first use); auto = cpu when it builds on a CPU device, else torch (pure PyTorch)"})
    numerics: str = field(default="invariant", metadata={
        "help": "invariant | fast: invariant = every row through kernels with a fixed reduction order, so "
                "a request's tokens and logprobs are bit-identical whatever shares its steps, however it "
                "is chunked, with or without prefix hits or preemption; fast = torch's GEMMs and SDPA "
                "(their blocking depends on the batch shape)"})

    kernels: str = field(default="auto", metadata={"unit": "KIND=PATH,...", 
        "help": "auto | KIND=PATH,...: kernels are chosen by measurement at first start and cached per CPU "
                "(see `streamkv info`); KIND=PATH forces one: linear=q4|dense|deq|q4f, gemm=amx|avx512|fma, "
                "lm_head=q8|dense|deq, attention_gather=stage|direct, attention=bf16|f32|amx|bf16f, "
                "prefill_attention=native|sdpa"})

    step_log: str | None = field(default=None, metadata={"unit": "PATH", "help": "append one JSON line per engine "
                                  "step (its sequences, rows, classes and seconds) to PATH, for diagnosis"})

    def __post_init__(self) -> None:
        check_types(self)
        from streamkv.native.choice import parse_kernels

        parse_kernels(self.kernels)  # ValueError naming the problem
        if self.numerics not in ("invariant", "fast"):
            raise ValueError(f"numerics must be invariant or fast, got {self.numerics!r}")
        if self.numerics == "invariant" and self.attention_backend == "torch":
            raise ValueError("attention_backend=torch (SDPA, whose blocking depends on the batch shape) is not "
                             "batch-invariant: use numerics=fast with it, or attention_backend=cpu|auto")
        if self.numerics == "invariant" and self.device != "cpu":
            raise ValueError("numerics=invariant has CPU kernels only so far; use numerics=fast on CUDA")
        if self.attention_backend not in ("auto", "torch", "cpu"):
            raise ValueError(f"attention_backend must be auto, torch or cpu, got {self.attention_backend!r}")
        if self.threads is not None and (not isinstance(self.threads, int) or isinstance(self.threads, bool)
                                         or not 1 <= self.threads <= MAX_THREADS):
            raise ValueError(f"threads must be an integer in [1, {MAX_THREADS}], got {self.threads!r}")
        if not re.fullmatch(r"cpu|cuda(:(0|[1-9][0-9]*))?", self.device, flags=re.ASCII):  # as torch parses it
            raise ValueError(f"device must be cpu or cuda[:N], got {self.device!r}")


@dataclass(frozen=True)
class SessionConfig:
    session_dir: str | None = field(default=None, metadata={"unit": "DIR", 
        "help": "directory where sessions persist (push log + KV snapshots); with it, sessions "
                "survive a restart and idle sessions can be offloaded to disk"})
    max_sessions: int = field(default=256, metadata={"unit": "SESSIONS", "help": "live sessions at most"})
    host_offload_bytes: int = field(default=2 << 30, metadata={"unit": "BYTES", 
        "help": "bytes of host memory for offloaded session KV before older ones go to disk"})
    checkpoint_idle_s: float = field(default=1.0, metadata={"unit": "SECONDS", 
        "help": "with --session-dir: snapshot a session's KV to disk once it has been idle this long"})
    adopt_sessions: bool = field(default=False, metadata={
        "help": "with --session-dir shared by several replicas: recover no session at start; load one from the "
                "dir on its first request instead (the cluster ingress decides which replica owns it)"})

    def __post_init__(self) -> None:
        check_types(self)
        if self.adopt_sessions and not self.session_dir:
            raise ValueError("adopt_sessions needs a session_dir (the shared directory sessions are adopted from)")
        if self.max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {self.max_sessions}")
        if self.host_offload_bytes < 0:
            raise ValueError(f"host_offload_bytes must be >= 0, got {self.host_offload_bytes}")
        if self.checkpoint_idle_s < 0:
            raise ValueError(f"checkpoint_idle_s must be >= 0, got {self.checkpoint_idle_s}")


@dataclass(frozen=True)
class InputStreamConfig:
    max_input_streams: int = field(default=256, metadata={"unit": "STREAMS", 
        "help": "streaming-input requests open (input not finished) at most; more are refused (429)"})
    input_stream_ttl_s: float = field(default=300.0, metadata={"unit": "SECONDS", 
        "help": "a streaming-input request whose input got no append/update/finish for this long is "
                "aborted and its KV freed"})

    def __post_init__(self) -> None:
        check_types(self)
        if self.max_input_streams < 1:
            raise ValueError(f"max_input_streams must be >= 1, got {self.max_input_streams}")
        if not self.input_stream_ttl_s > 0:
            raise ValueError(f"input_stream_ttl_s must be positive, got {self.input_stream_ttl_s}")


@dataclass(frozen=True)
class KVPolicyConfig:
    """Server defaults of the per-request KV policies (``streamkv.policies``); a request's own
    ``kv_write`` / ``kv_read`` replaces them (``{"policy": "none"}`` turns one off)."""

    kv_write: str | None = field(default=None, metadata={"unit": "JSON", 
        "help": "default write-time KV policy, a JSON object, e.g. '{\"policy\": \"snapstream\", "
                "\"budget_tokens\": 1024}' (snapstream | streaming_llm | none): long prompts keep sinks, "
                "their top tokens by SnapKV score and a ring of recent tokens; the rest of their KV is freed"})
    kv_read: str | None = field(default=None, metadata={"unit": "JSON", 
        "help": "default read-time KV policy, a JSON object, e.g. '{\"policy\": \"quest\", "
                "\"budget_tokens\": 1024}' (quest | recent | none): each step reads only the best pages"})

    def __post_init__(self) -> None:
        check_types(self)
        self.write_policy, self.read_policy  # noqa: B018  (validates: ValueError with the problem)

    @property
    def write_policy(self) -> object:
        from streamkv.policies.write import make_write_policy

        return make_write_policy(_json_object("kv_write", self.kv_write))

    @property
    def read_policy(self) -> object:
        from streamkv.policies.read import make_read_policy, request_read_spec

        return make_read_policy(request_read_spec(_json_object("kv_read", self.kv_read)))


def _json_object(name: str, text: str | None) -> dict[str, object] | None:
    import json

    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{name} must be a JSON object: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {text!r}")
    return value


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    sessions: SessionConfig = field(default_factory=SessionConfig)
    inputs: InputStreamConfig = field(default_factory=InputStreamConfig)
    kv_policies: KVPolicyConfig = field(default_factory=KVPolicyConfig)

    def __post_init__(self) -> None:
        check_types(self)
        if self.scheduler.speculation == "pld" and self.runtime.numerics != "invariant":
            raise ValueError("speculation needs numerics=invariant: only there does a verified chunk row "
                             "compute exactly what a decode row does (so the output stays unchanged)")

    @classmethod
    def from_flat(cls, **kwargs: object) -> "EngineConfig":
        """Build from flat keyword arguments (``dtype=..., max_num_seqs=...``)."""
        from dataclasses import fields

        parts: dict[str, dict[str, object]] = {}
        known = {}
        for f in fields(cls):
            for sub in fields(f.default_factory()):  # type: ignore[misc]
                known[sub.name] = f.name
        for key, value in kwargs.items():
            if key not in known:
                raise ValueError(f"unknown engine option {key!r}; known: {sorted(known)}")
            parts.setdefault(known[key], {})[key] = value
        sections = {f.name: f.default_factory() for f in fields(cls)}  # type: ignore[misc]
        for name, values in parts.items():
            sections[name] = type(sections[name])(**values)
        return cls(**sections)
