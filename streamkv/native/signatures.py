"""The C signatures of the kernels library (``streamkv/native/*.c``), declared once on load."""
from __future__ import annotations

import ctypes


def declare(lib: ctypes.CDLL) -> None:
    """Set ``argtypes`` / ``restype`` of every exported function of ``lib``."""
    fn = lib.streamkv_decode_attn
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 5 + [ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                                          ctypes.c_float, ctypes.c_int64, ctypes.c_void_p]
    fn = lib.streamkv_paged_attn
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                           ctypes.c_float, ctypes.c_int64, ctypes.c_void_p]
    lib.streamkv_paged_attn_available.restype = ctypes.c_int
    fn = lib.streamkv_q4_gemm
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                   ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.streamkv_q4_available.restype = ctypes.c_int
    fn = lib.streamkv_q8_gemm
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                   ctypes.c_void_p]
    fn = lib.streamkv_page_select
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] + [ctypes.c_int] * 5 + [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                                            ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p,
                                                            ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                                                            ctypes.c_void_p]
    fn = lib.streamkv_page_shares
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] + [ctypes.c_int] * 5 + [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                                            ctypes.c_float, ctypes.c_void_p, ctypes.c_int,
                                                            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                                            ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                                                            ctypes.c_void_p]
    fn = lib.streamkv_inv_gemm
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                   ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    fn = lib.streamkv_deq_gemm
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                   ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    fn = lib.streamkv_deq_gemm_bf16
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                   ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.streamkv_deq_bf16_available.restype = ctypes.c_int
    lib.streamkv_inv_gemm_bf16_dot.restype = ctypes.c_int
    lib.streamkv_inv_gemm_bf16_path.restype = ctypes.c_char_p
    fn = lib.streamkv_inv_attn
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                           ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_void_p]
    fn = lib.streamkv_inv_attn_bf16
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                           ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
    lib.streamkv_inv_attn_bf16_available.restype = ctypes.c_int
    lib.streamkv_inv_attn_amx_available.restype = ctypes.c_int
    lib.streamkv_inv_isa.restype = ctypes.c_char_p
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    signatures = {  # native/layer.c (the model struct is passed by reference)
        "streamkv_fwd": [p, p, i64, p, p, p, i32, p, p],
        "streamkv_fwd_sel": [p, p, i64, p, p, p, i32, p, p, p, i32, p, i64, i32, ctypes.c_uint64, p],
        "streamkv_fwd_pre": [p, i32, p, i64, p, p, p, p],
        "streamkv_fwd_attn": [p, i32, p, p, i32, p, p],
        "streamkv_fwd_post": [p, i32, p, i64, p, p],
        "streamkv_rms_norm": [p, i64, i32, p, ctypes.c_float, p, i32],
        "streamkv_silu_mul": [p, i64, i32, p, i32],
        "streamkv_inv_gemm_silu": [p, i64, i32, p, i32, p, i32],
        "streamkv_inv_gemm_silu_f32": [p, i64, i32, p, i32, p],
    }
    for name, args in signatures.items():
        getattr(lib, name).argtypes = args
        getattr(lib, name).restype = ctypes.c_int
    lib.streamkv_fwd_workspace.argtypes = [p, i64]
    lib.streamkv_fwd_workspace.restype = ctypes.c_size_t
    fn = lib.streamkv_kv_move_ordered
    fn.restype = ctypes.c_int
    fn.argtypes = [i32, p, p, i32, i64, i32, i32, p, p, i64, p]
    fn = lib.streamkv_kv_move_between
    fn.restype = ctypes.c_int
    fn.argtypes = [i32, p, p, i64, p, p, i64, i32, i32, i32, p, p, i64, p]
    lib.streamkv_gguf_dequant.restype = ctypes.c_int
    lib.streamkv_gguf_dequant.argtypes = [i32, p, i64, p]
    fn = lib.streamkv_page_bounds
    fn.restype = None
    fn.argtypes = [p, i32, i32, i64, i32, i32, i32, p, i32, p, i64]
