#!/usr/bin/env bash
# Source this (test.sh and run.sh do) to run Tether's processes on tcmalloc instead of glibc's
# malloc, where libtcmalloc_minimal is installed (scripts/env_system.sh installs it with apt-get
# where it can). `bash scripts/malloc.sh --find` prints the library's path, or nothing.
#
# Why: glibc returns large freed blocks (activations, logits, weight buckets, received frames)
# to the kernel, and every new one is faulted in and zeroed again. On this 2-core CPU machine
# the kernel's page zeroing (clear_page_erms) was 27 % of all CPU samples during a SmolLM2
# preset run (perf). With tcmalloc the same 3-step run took 132 CPU-s against 156, the toy
# vLLM run (150 steps) 112 against 122 (docs/benchmarks.md). vLLM gives the same advice for
# its CPU backend. Children (actors, vLLM's and SGLang's processes) inherit LD_PRELOAD.
_tether_tcmalloc() {
  local lib
  for lib in /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 \
             /usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4 /usr/lib64/libtcmalloc_minimal.so.4; do
    [ -f "$lib" ] && { echo "$lib"; return; }
  done
}
if [ "${1:-}" = "--find" ]; then
  _tether_tcmalloc
elif [ "${TETHER_TCMALLOC:-1}" != 0 ]; then  # TETHER_TCMALLOC=0: glibc's malloc
  _tether_lib=$(_tether_tcmalloc)
  if [ -n "$_tether_lib" ]; then
    case ":${LD_PRELOAD:-}:" in
      *":$_tether_lib:"*) ;;
      *) export LD_PRELOAD="$_tether_lib${LD_PRELOAD:+:$LD_PRELOAD}" ;;
    esac
  fi
  unset _tether_lib
fi
unset -f _tether_tcmalloc
