"""A native kernel that cannot allocate its buffers returns rc 3 (a ``MemoryError``), writes
nothing and keeps no state: the next call gives the same bits as before. Each case runs in a
subprocess under an address-space limit (``RLIMIT_AS``) that leaves room for the call's small
allocations but not its large ones; malloc's thresholds are fixed there, so a large block is
always a fresh mapping (which the limit refuses), never memory an earlier call freed. Before
rc 3 existed, these calls crashed the process (SIGSEGV)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from streamkv.native import deq_gemm_bf16, invariant_attention, invariant_attention_bf16, invariant_gemm_bf16_path

_PROBE = """
import ctypes, resource, sys, torch
libc = ctypes.CDLL(None)
libc.mallopt(-3, 128 << 10)  # M_MMAP_THRESHOLD: fixed, so a large block is always a fresh mmap
libc.mallopt(-1, 128 << 10)  # M_TRIM_THRESHOLD
g = torch.Generator().manual_seed(21)
CASE = sys.argv[1]


def q4_case(fma, rows, room):
    from streamkv.models.q4_linear import pack_native
    from streamkv.native import q4_gemm
    k, n = 32 * 8192, 256  # per-thread buffers 16 MiB (dot chain) / 48 MiB (fma); 16 tiles: work for every thread
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    w, sz = pack_native(q, torch.rand(n, k // 32, generator=g) * 0.05, torch.randn(n, k // 32, generator=g) * 0.05)
    x = torch.randn(rows, k, generator=g).bfloat16()
    kernel = q4_gemm()
    return (lambda: kernel(x, w, sz, n, torch.float32, fma)), room


def attn_case(kernel, dtype, rows):
    kc = torch.randn(8192, 3, 64, generator=g).to(dtype)
    vc = torch.randn(8192, 3, 64, generator=g).to(dtype)
    if rows == "prefill":   # 256 rows after 7,936 cached: transposed blocks / partials of ~6-10 MB
        seqs, slots = torch.tensor([(0, 256, 0, 8192)]), torch.randperm(8192, generator=g)
    elif rows == "items":   # 100 decodes over 65,536 keys: 12,800 chunk items (~0.5 MB), the first allocation
        kc, vc = kc.repeat(8, 1, 1), vc.repeat(8, 1, 1)
        seqs, slots = torch.tensor([(b, 1, 0, 65536) for b in range(100)]), torch.randperm(65536, generator=g)
        slots = slots.repeat(100)
        seqs[:, 2] = torch.arange(100) * 65536
    else:                   # 64 decodes over 4,096 keys each, split by chunk: ~1.2 MB of partials
        seqs = torch.tensor([(b, 1, 0, 4096) for b in range(64)])
        slots = torch.randperm(8192, generator=g)[:4096]
    q = torch.randn(int(seqs[:, 1].sum()), 9, 64, generator=g)
    room = {"prefill": 2 << 20, "decode": 512 << 10, "items": 400 << 10}[rows]  # out fits, the large blocks not
    return (lambda: kernel(q, kc, vc, seqs, slots, 0.125)), room


def dense_case(kind):
    # the dense bf16 GEMM (inv_gemm.c): "fma" widens x (32 MiB: 1,024 x 8,192 float32), "amx" pads the
    # last partial row tile per thread (17 rows: 512 KiB each); "deq" (deq_bf16.c) unpacks the 4-bit
    # weights into dense panels (16 MiB) before that GEMM
    from streamkv.models.linear import pack_dense
    from streamkv.native import deq_gemm_bf16, invariant_gemm
    k, n = 8192, 256
    if kind == "deq":
        from streamkv.models.deq_linear import pack_deq_bf16
        from streamkv.native.kernel_bench import _random_q4
        n = 1024
        w, dm = pack_deq_bf16(*_random_q4(n, k))
        x, kernel = torch.randn(4, k, generator=g).bfloat16(), deq_gemm_bf16()
        return (lambda: kernel(x, w, dm, n, torch.float32)), 4 << 20
    wp = pack_dense((torch.randn(n, k, generator=g) * 0.02).bfloat16())
    x = torch.randn(1024 if kind == "fma" else 17, k, generator=g).bfloat16()
    kernel, room = invariant_gemm(), {"fma": 4 << 20, "amx": 256 << 10}[kind]
    return (lambda: kernel(x, wp, n, torch.float32, tiles=kind == "amx", fma=kind == "fma")), room


def fast_decode_case():   # the fast-math decode kernel: 64 rows over 4,096 keys, ~2.4 MB of partials
    from streamkv.native import decode_attention
    kc = torch.randn(8192, 3, 64, generator=g).bfloat16()
    vc = torch.randn(8192, 3, 64, generator=g).bfloat16()
    slots = torch.randperm(8192, generator=g)[:4096].repeat(64)
    offsets, q, kernel = torch.arange(65) * 4096, torch.randn(64, 9, 64, generator=g), decode_attention()
    return (lambda: kernel(q, kc, vc, slots, offsets, 0.125, 256)), 512 << 10


def fast_paged_case():   # the fast-math mixed-batch kernel: 64 decodes over 4,096 keys, ~2.4 MB of partials
    from streamkv.native import paged_attention
    kc = torch.randn(8192, 3, 64, generator=g).bfloat16()
    vc = torch.randn(8192, 3, 64, generator=g).bfloat16()
    seqs, slots = torch.tensor([(b, 1, 0, 4096) for b in range(64)]), torch.randperm(8192, generator=g)[:4096]
    q, kernel = torch.randn(64, 9, 64, generator=g).bfloat16(), paged_attention()
    return (lambda: kernel(q, kc, vc, seqs, slots, 0.125, 256)), 512 << 10


def quest_case():   # Quest's page ranking over 100,000 candidate pages: ~19 MB of per-page bounds products
    from streamkv.native import page_select
    q, bounds = torch.randn(1, 3, 3, 64, generator=g), torch.randn(100000, 3, 128, generator=g).bfloat16()
    cand, kernel = torch.arange(100000), page_select()
    return (lambda: kernel(q, bounds, cand, 64, 0.125)[0]), 1536 << 10


def case():
    from streamkv.native import invariant_attention, invariant_attention_bf16
    if CASE == "quest-select":
        return quest_case()
    if CASE == "fast-paged":
        return fast_paged_case()
    if CASE.startswith("q4"):
        # q4-fma: 33 rows take the many-row blocking (x widened, 34.6 MB, fits; the per-thread buffers
        # not); q4-fma-mid: 8 rows take the chunked one, whose widened x (8 MiB) is its large block
        return q4_case(*{"q4-dot": (False, 8, 4 << 20), "q4-fma": (True, 33, 40 << 20),
                         "q4-fma-mid": (True, 8, 4 << 20)}[CASE])
    if CASE == "fast-decode":
        return fast_decode_case()
    if CASE.startswith("dense"):
        return dense_case(CASE.split("-")[1])
    kernel, dtype = (invariant_attention_bf16(), torch.bfloat16) if CASE.startswith("bf16") else \\
        (invariant_attention(), torch.float32)
    return attn_case(kernel, dtype, CASE.split("-")[1])


def vm_bytes():
    for line in open("/proc/self/status"):
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024


call, room = case()
want = call()
soft, hard = resource.getrlimit(resource.RLIMIT_AS)
resource.setrlimit(resource.RLIMIT_AS, (vm_bytes() + room, hard))
try:
    call()
    sys.exit("no MemoryError")
except MemoryError as e:
    assert "could not allocate" in str(e), e
finally:
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
assert torch.equal(call(), want)
print("ok")
"""

_BF16 = pytest.mark.skipif(invariant_attention_bf16() is None, reason="no AVX512-BF16: the bf16 kernels are not built")
_AMX = pytest.mark.skipif(invariant_gemm_bf16_path() != "amx", reason="no AMX tiles on this CPU")
_DEQ = pytest.mark.skipif(deq_gemm_bf16() is None, reason="no AVX512-BF16 with VBMI: deq_bf16.c is not built")
CASES = [pytest.param("q4-dot", marks=_BF16), pytest.param("q4-fma", marks=_BF16),
         pytest.param("q4-fma-mid", marks=_BF16),
         pytest.param("bf16-prefill", marks=_BF16), pytest.param("bf16-decode", marks=_BF16),
         pytest.param("bf16-items", marks=_BF16),
         "f32-prefill", "f32-decode", "fast-decode", pytest.param("fast-paged", marks=_BF16), "quest-select",
         "dense-fma", pytest.param("dense-amx", marks=_AMX), pytest.param("dense-deq", marks=_DEQ)]


@pytest.mark.skipif(invariant_attention() is None or not sys.platform.startswith("linux"),
                    reason="needs the native kernels and Linux (RLIMIT_AS, /proc)")
@pytest.mark.parametrize("case", CASES)
def test_a_kernel_without_memory_raises_and_the_next_call_gives_the_same_bits(case):
    r = subprocess.run([sys.executable, "-c", _PROBE, case], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), (r.returncode, r.stdout[-500:], r.stderr[-2000:])
