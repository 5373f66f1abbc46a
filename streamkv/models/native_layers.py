"""The decoder layers of the invariant numerics in one native call per step (``native/layer.c``).

Built once per model from its invariant-mode weights (``InvariantLinear``: 4-bit or dense panels),
its norms and RoPE tables, and the paged KV cache the attention backend owns. A step is then:

    x = embed[ids] (float32)  ──streamkv_fwd──▶  x after every layer        (one ctypes call)

and, when a read policy picks pages from each layer's own queries, per layer:

    streamkv_fwd_pre ──q──▶ selector.for_layer ──▶ streamkv_fwd_attn ──▶ streamkv_fwd_post

Both run the same C functions, so a row's bits do not depend on which of the two ran.
"""
from __future__ import annotations

import ctypes
from typing import Any

import torch
import torch.nn.functional as F

from streamkv.attention.backend import KVCache
from streamkv.native.exact_ops import gemm_path


class SkLinear(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int), ("N", ctypes.c_int), ("K", ctypes.c_int), ("wbf16", ctypes.c_int),
                ("tiles", ctypes.c_int), ("w", ctypes.c_void_p), ("sz", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("deq", ctypes.c_void_p), ("deq_dm", ctypes.c_void_p), ("deq_rows", ctypes.c_int)]


class SkLayer(ctypes.Structure):
    _fields_ = [("qkv", SkLinear), ("o", SkLinear), ("gate_up", SkLinear), ("down", SkLinear),
                ("attn_norm", ctypes.c_void_p), ("mlp_norm", ctypes.c_void_p), ("qk_norm", ctypes.c_void_p),
                ("kc", ctypes.c_void_p), ("vc", ctypes.c_void_p)]


class SkSelect(ctypes.Structure):
    _fields_ = [("q_row", ctypes.c_int64), ("cand", ctypes.c_void_p), ("P", ctypes.c_int), ("keep", ctypes.c_int),
                ("full", ctypes.c_void_p), ("sink_len", ctypes.c_int64), ("tail_from", ctypes.c_int64),
                ("ctx_len", ctypes.c_int64), ("out_off", ctypes.c_int64), ("pos", ctypes.c_void_p),
                ("picked", ctypes.c_void_p), ("rows", ctypes.c_int), ("wrows", ctypes.c_int), ("first", ctypes.c_int64),
                ("scratch", ctypes.c_void_p), ("shares", ctypes.c_void_p)]


class SkModel(ctypes.Structure):
    _fields_ = [("n_layers", ctypes.c_int), ("d", ctypes.c_int), ("H", ctypes.c_int), ("Hk", ctypes.c_int),
                ("D", ctypes.c_int), ("inter", ctypes.c_int), ("act_bf16", ctypes.c_int), ("kv_bf16", ctypes.c_int),
                ("attn_bf16", ctypes.c_int), ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("cos_t", ctypes.c_void_p), ("sin_t", ctypes.c_void_p), ("layers", ctypes.POINTER(SkLayer)),
                ("prof", ctypes.c_void_p)]

ATTENTION_MODES = {"f32": 0, "bf16": 1, "amx": 2, "bf16f": 3}  # SkModel.attn_bf16 (native/layer.c)
DIRECT = 4  # SkModel.attn_bf16 bit: the bf16 kernels' few-row items gather from the pool (attention_gather)
PHASES = ("norm", "gemm", "rope_kv", "attention", "silu", "residual", "select")  # native/layer.c's timed phases
# ("silu" is 0 where the gate_up GEMM applies it itself, in "gemm": dense bf16 or float32 prompt rows)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class NativeLayers:
    """Every decoder layer of ``model`` over ``cache``: hidden states in, hidden states out.

    ``attention`` picks the attention kernel (``f32``: ``inv_attn.c``; ``bf16``: ``inv_attn_bf16.c``;
    ``amx``: that one on AMX tiles; ``bf16f``: that one's products as float32 fmas; ``gather``:
    ``direct`` for the bf16 kernels' pool gathers, see ``attention_gather``), the same one the
    attention backend uses, so both paths agree with the backend's own ``forward``.
    """

    def __init__(self, lib: ctypes.CDLL, model: Any, cache: KVCache, scale: float, attention: str,
                 gather: str = "stage") -> None:
        arch = model.arch
        d, inter = arch.hidden_size, arch.intermediate_size
        h, hk, hd = arch.num_heads, arch.num_kv_heads, arch.head_dim
        if hd % 16 or hd > 256:
            raise ValueError(f"the native layers need a head_dim that is a multiple of 16 up to 256, got {hd}")
        self.lib = lib
        self.keep: list[torch.Tensor] = []  # everything C points at stays alive with this object
        layers = (SkLayer * len(model.layers))()
        for i, layer in enumerate(model.layers):
            qk = getattr(layer, "qk_norm", None)
            layers[i] = SkLayer(self._linear(layer.qkv), self._linear(layer.o_proj), self._linear(layer.gate_up),
                                self._linear(layer.down), self._f32(layer.attn_norm), self._f32(layer.mlp_norm),
                                self._f32(qk), _ptr(cache.k[i]), _ptr(cache.v[i]))
        bf16 = model.dtype == torch.bfloat16
        rope = model.rope
        mode = ATTENTION_MODES[attention] | (DIRECT if gather == "direct" else 0)
        self.model = SkModel(len(model.layers), d, h, hk, hd, inter, int(bf16), int(cache.k.dtype == torch.bfloat16),
                             mode, arch.rms_norm_eps, scale, self._f32(rope.cos_table), self._f32(rope.sin_table),
                             layers, None)
        self.layers = layers
        self.embed = model.embed
        self.hidden, self.heads, self.head_dim = d, h, hd
        self.act_dtype = torch.bfloat16 if bf16 else torch.float32
        self.eps = arch.rms_norm_eps
        self.workspace = torch.empty(0, dtype=torch.uint8)

    def _f32(self, t: torch.Tensor | None) -> int | None:
        if t is None:
            return None
        t = t.detach().float().contiguous()
        self.keep.append(t)
        return t.data_ptr()

    def _linear(self, lin: Any) -> SkLinear:
        bias = self._f32(lin.bias)
        if lin.q4 is not None:
            packed = lin.q4.packed
            return SkLinear(1, lin.q4.out_features, packed.shape[1] * 32, 1, int(lin.q4.fma), packed.data_ptr(),
                            lin.q4.scales_zeros.data_ptr(), bias)
        panels = lin.dense.panels
        wbf16 = panels.dtype == torch.bfloat16
        k = panels.shape[1] * (2 if wbf16 else 1)
        deq = lin.deq  # same bits as the panels: small steps read it (native/deq_gemm.c)
        return SkLinear(0, lin.dense.out_features, k, int(wbf16), gemm_path(lin.dense.tiles, lin.dense.fma),
                        panels.data_ptr(), None, bias,
                        _ptr(deq.packed) if deq else None, _ptr(deq.dm) if deq else None, deq.max_rows if deq else 0)

    def profile(self, on: bool) -> torch.Tensor | None:
        """Start (zeroed) or stop timing the native phases; returns the float64 [len(PHASES)]
        seconds accumulated so far (the tensor C writes into while on)."""
        if on:
            self.timings = torch.zeros(len(PHASES), dtype=torch.float64)
            self.model.prof = self.timings.data_ptr()
        else:
            self.model.prof = None
        return getattr(self, "timings", None)

    def _work(self, rows: int) -> int:
        need = int(self.lib.streamkv_fwd_workspace(ctypes.addressof(self.model), rows))
        if self.workspace.numel() < need:
            self.workspace = torch.empty(need, dtype=torch.uint8)
        return self.workspace.data_ptr()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, backend: Any, meta: Any) -> torch.Tensor:
        """input_ids, positions [T] -> hidden [T, d] float32 after the last layer (before the final norm);
        ``meta``: the invariant backend's step metadata (slot mapping, sequences, context slots)."""
        x = F.embedding(input_ids, self.embed).float()
        t = x.shape[0]
        ws = self._work(t)
        m = ctypes.addressof(self.model)
        if meta.selector is None and not meta.observe:
            rc = self.lib.streamkv_fwd(m, _ptr(x), t, _ptr(positions), _ptr(meta.slot_mapping), _ptr(meta.seqs),
                                       meta.seqs.shape[0], _ptr(meta.slots), ws)
            self._check(rc, "forward", t)
            return x
        fused = meta.selector.fused() if meta.selector is not None and not meta.observe else None
        if fused is not None:
            return self._forward_selecting(x, positions, meta, fused, backend.cache, ws)
        q = torch.empty(t, self.heads, self.head_dim, dtype=torch.float32)
        attn = torch.empty_like(q)
        for layer in range(len(self.layers)):
            self._check(self.lib.streamkv_fwd_pre(m, layer, _ptr(x), t, _ptr(positions), _ptr(meta.slot_mapping),
                                                  _ptr(q), ws), "pre", t)
            lm = backend.layer_meta(layer, q, meta)
            self._check(self.lib.streamkv_fwd_attn(m, layer, _ptr(q), _ptr(lm.seqs), lm.seqs.shape[0],
                                                   _ptr(lm.slots), _ptr(attn)), "attention", t)
            self._check(self.lib.streamkv_fwd_post(m, layer, _ptr(x), t, _ptr(attn), ws), "post", t)
        return x

    def _forward_selecting(self, x: torch.Tensor, positions: torch.Tensor, meta: Any, fused: Any, cache: Any,
                           ws: int) -> torch.Tensor:
        """Every layer in one call, each re-scoring the pages of the step's selecting decode rows
        and question rows, or reading the pages a row reuses (``streamkv_fwd_sel``: the
        per-layer path's functions, in its order)."""
        keep = []  # everything the C structs point at
        entries = (SkSelect * len(fused.entries))()
        for j, e in enumerate(fused.entries):
            c = e.choice
            pos = torch.empty(max(1, e.rows) * c.plan.keep, dtype=torch.int64)
            scratch = torch.empty(e.rows, c.candidates.numel()) if e.rows else None  # a question's shares, per layer
            keep += [pos, scratch, c.candidates, c.slots.full, e.picked, e.shares]
            entries[j] = SkSelect(e.q_row, _ptr(c.candidates), c.candidates.numel(), c.plan.keep, _ptr(c.slots.full),
                                  c.slots.sink_len, c.slots.tail_from, c.slots.full.numel(), e.offset, _ptr(pos),
                                  _ptr(e.picked), e.rows, 0 if e.shares is None else e.shares.shape[1], e.first,
                                  _ptr(scratch), _ptr(e.shares))
        bounds = cache.bounds.data
        layers = fused.recall_layers
        q = torch.empty(len(layers), x.shape[0], self.heads, self.head_dim, dtype=torch.float32) if layers else None
        rc = self.lib.streamkv_fwd_sel(ctypes.addressof(self.model), _ptr(x), x.shape[0], _ptr(positions),
                                       _ptr(meta.slot_mapping), _ptr(fused.seqs), fused.seqs.shape[0],
                                       _ptr(fused.slots), ws, ctypes.addressof(entries), len(fused.entries), _ptr(bounds),
                                       bounds[0].numel(), cache.block_size, sum(1 << layer for layer in layers), _ptr(q))
        self._check(rc, "forward with page selection", x.shape[0])
        meta.selector.after_fused(fused, q)
        return x

    def norm(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The final RMSNorm, hidden [N, d] float32 -> [N, d] in the GEMM input dtype (same as the layers')."""
        hidden = hidden.float().contiguous()
        out = torch.empty(hidden.shape, dtype=self.act_dtype)
        if hidden.shape[0]:
            self._check(self.lib.streamkv_rms_norm(_ptr(hidden), hidden.shape[0], self.hidden, _ptr(weight),
                                                   ctypes.c_float(self.eps), _ptr(out),
                                                   int(self.act_dtype == torch.bfloat16)), "norm", hidden.shape[0])
        return out

    @staticmethod
    def _check(rc: int, what: str, rows: int) -> None:
        if rc == 103:  # a layer's GEMM or attention found no memory for its buffers (100 + 3)
            raise MemoryError(f"native {what} on {rows} rows: a kernel could not allocate its buffers")
        if rc != 0:
            raise RuntimeError(f"native {what} failed on {rows} rows (rc={rc})")
