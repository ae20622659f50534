#!/usr/bin/env bash
# System packages the tests need, installed with apt where this machine allows it (root, or
# passwordless sudo); elsewhere it says what is missing and goes on. Idempotent: installs only
# what is absent. Each package is its own block, so more can be added independently.
set -uo pipefail
apt_install() {  # apt_install PACKAGE BINARY
  command -v "$2" >/dev/null && return 0
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo -n"
  if command -v apt-get >/dev/null && { [ -z "$sudo" ] || sudo -n true 2>/dev/null; }; then
    echo "[env] installing $1 (apt-get)" >&2
    $sudo apt-get update -qq >/dev/null && $sudo apt-get install -y -qq "$1" >/dev/null
  fi
  command -v "$2" >/dev/null || echo "[env] $1 is not installed and could not be ($2 missing);" \
    "tests that need it are skipped" >&2
}

# bubblewrap: the python tool's sandbox (actors/agents/sandbox.py)
apt_install bubblewrap bwrap
exit 0
