"""The attention backend seam: metadata built once per step, used by every layer.

A backend owns how K/V are written into and read from the paged cache. The reference
backend (``torch_ref``) is pure PyTorch and is the oracle for faster GPU backends, which
plug in here with the same two methods.
"""
from __future__ import annotations

import inspect
import math
import mmap
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from streamkv.kv.bounds import PageBounds
from streamkv.policies.read import ReadPolicy


@dataclass(frozen=True)
class SeqSpan:
    """One sequence's rows in the flattened batch: rows [q_start, q_start + q_len) hold
    positions [start, start + q_len); its KV lives in ``block_table``. With ``read``, each
    layer attends only to the pages that policy picks (see :mod:`streamkv.policies.read`);
    ``seq_id`` names the sequence for state a backend keeps across steps.

    A compressed sequence (``streamkv.policies.write``) holds a fixed set of ``rows`` rows: its
    one new row (position ``start``) is written to row ``write_row`` of its ring and attends to
    every row; its rows from ``ring_from`` on are that ring (the newest tokens, which a read
    policy always reads, as the tail it always reads of other spans). Otherwise (``rows`` = -1)
    row i holds position i.

    ``num_prompt``: rows at positions from it on are the answer's (a read policy without
    ``rescore`` has them reuse the pages the question's last rows chose); -1: every row is.
    ``policy_from``: the first row under ``read`` (the question's), which every question row
    reads whole, however the question was chunked (-1: the span's own first row).
    """

    q_start: int
    q_len: int
    start: int
    block_table: tuple[int, ...]
    read: ReadPolicy | None = None
    seq_id: int = -1
    rows: int = -1
    write_row: int = -1
    ring_from: int = -1
    num_prompt: int = -1
    policy_from: int = -1

    @property
    def ctx_len(self) -> int:
        """Context rows the span's queries attend over (the last ``q_len`` are its own, causally)."""
        return self.rows if self.rows >= 0 else self.start + self.q_len

    @property
    def write_from(self) -> int:
        """Row of the span's first new token."""
        return self.write_row if self.rows >= 0 else self.start

    @property
    def read_from(self) -> int:
        """First row a read policy must read whatever it picks: the span's own new rows, or its
        whole ring (which holds them) once compressed."""
        return self.ring_from if self.rows >= 0 else self.start

    @property
    def is_decode(self) -> bool:
        """One new token after earlier context: the row kind decode kernels and decode weights serve."""
        return self.q_len == 1 and self.start > 0


@dataclass(frozen=True)
class Observation:
    """Keep the queries (after RoPE) of rows ``[q_row, q_row + n)`` of a step in ``into[layer,
    offset:offset + n]`` (``into`` [layers, N, heads, head_dim] float32): a write policy scores
    the prompt's keys with its last rows' queries (``streamkv.policies.write``)."""

    q_row: int
    n: int
    offset: int
    into: torch.Tensor

    @staticmethod
    def record(observe: Sequence["Observation"], layer: int, q: torch.Tensor) -> None:
        for o in observe:
            o.into[layer, o.offset:o.offset + o.n] = q[o.q_row:o.q_row + o.n].float()


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero tensor; on the CPU backed by anonymous pages the OS zero-fills on first touch.

    ``torch.zeros`` writes every byte of a GB-sized pool at start (about 1 s on a 2-core
    machine); here only the pages a sequence reaches are ever touched.
    """
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    n = math.prod(shape) * dtype.itemsize
    try:
        raw = torch.frombuffer(mmap.mmap(-1, max(n, 1)), dtype=torch.uint8)[:n]  # mmap of 0 bytes fails
    except (OSError, OverflowError) as exc:
        raise ValueError(f"cannot allocate {n:,} bytes for the KV cache ({exc}): lower kv_cache_memory or "
                         "num_blocks") from None
    return raw.view(dtype).view(shape)


class KVCache:
    """Paged K/V tensors, one flat slot axis per layer.

    ``k[layer]`` and ``v[layer]`` are [num_blocks * block_size, num_kv_heads, head_dim];
    slot ``b * block_size + i`` holds token ``i`` of block ``b``. Keys are stored after RoPE.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.k = lazy_zeros(shape, dtype, device)
        self.v = lazy_zeros(shape, dtype, device)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.bounds: PageBounds | None = None  # made on first use by a page-selecting read policy

    def page_bounds(self) -> PageBounds:
        if self.bounds is None:
            self.bounds = PageBounds(self.k, self.block_size)
        return self.bounds

    def written(self, slots: torch.Tensor) -> None:
        """Every write into the cache reports its slots here (keeps page bounds honest)."""
        if self.bounds is not None:
            self.bounds.invalidate(slots)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + (self.bounds.nbytes if self.bounds is not None else 0)


class AttentionBackend(ABC):
    """Template: :meth:`prepare` once per step, then :meth:`forward` per layer."""

    def __init__(self, cache: KVCache, scale: float) -> None:
        self.cache = cache
        self.scale = scale

    @abstractmethod
    def prepare(self, spans: list[SeqSpan], num_tokens: int, observe: Sequence[Observation] = ()) -> Any:
        """Build per-step metadata (slot mapping, gather indices, masks) for ``spans``; every
        layer's queries of the ``observe`` rows are copied out as the layer runs."""

    @abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: Any) -> torch.Tensor:
        """Store k/v [T, Hkv, D] in the cache and attend: q [T, H, D] -> out [T, H, D]."""

    def release(self, seq_ids: Sequence[int]) -> None:
        """Forget per-sequence state of finished sequences (none by default)."""


BACKENDS: dict[str, Callable[[KVCache, float], AttentionBackend]] = {}


def register_backend(name: str) -> Callable[[type[AttentionBackend]], type[AttentionBackend]]:
    def wrap(cls: type[AttentionBackend]) -> type[AttentionBackend]:
        BACKENDS[name] = cls
        return cls
    return wrap


def make_backend(name: str, cache: KVCache, scale: float, **options: Any) -> AttentionBackend:
    """The backend ``name``; ``options`` (the kernel choice: ``bf16`` for cpu_invariant, ``paged`` for
    cpu) are passed to the backends that take them and ignored by the others."""
    import streamkv.attention.cpu_invariant  # noqa: F401  (registration)
    import streamkv.attention.cpu_native  # noqa: F401
    import streamkv.attention.torch_ref  # noqa: F401

    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {sorted(BACKENDS)}")
    cls = BACKENDS[name]
    accepted = inspect.signature(cls).parameters
    return cls(cache, scale, **{k: v for k, v in options.items() if k in accepted})
