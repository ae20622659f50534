#!/usr/bin/env bash
# System packages for the multi-host tests (test.sh calls this; it never fails the suite):
#   slurm-wlm + munge  tests/test_slurm.py starts its own one-node Slurm with them
#   iproute2           tests/test_hosts.py makes network namespaces with `ip netns`
# Installs with apt-get only what is missing, and only as root; otherwise it says why not,
# and the tests that need the package skip with that reason.
set -uo pipefail
want=()
for pair in slurmctld:slurm-wlm slurmd:slurm-wlm sbatch:slurm-wlm munged:munge ip:iproute2; do
  cmd=${pair%%:*}; pkg=${pair#*:}
  command -v "$cmd" >/dev/null 2>&1 || [[ " ${want[*]} " == *" $pkg "* ]] || want+=("$pkg")
done
if [ ${#want[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "[env_slurm] not root: not installing ${want[*]} (the Slurm / namespace tests will skip)" >&2
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "[env_slurm] no apt-get: not installing ${want[*]} (the Slurm / namespace tests will skip)" >&2
  exit 0
fi
echo "[env_slurm] apt-get install ${want[*]} ..." >&2
export DEBIAN_FRONTEND=noninteractive
if apt-get update -q >/tmp/tether-env-slurm.log 2>&1 \
   && apt-get install -y -q "${want[@]}" >>/tmp/tether-env-slurm.log 2>&1; then
  echo "[env_slurm] installed ${want[*]}" >&2
else
  echo "[env_slurm] apt-get failed (see /tmp/tether-env-slurm.log): ${want[*]} missing, those tests will skip" >&2
fi
exit 0
