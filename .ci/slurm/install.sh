#!/usr/bin/env bash
# Install Debian's Slurm and munge for the test cluster (tests/e2e/test_slurm.py); nothing when they
# are there already. About 11 s on a fresh Debian 12 machine (apt-get update not counted).
set -euo pipefail
need=()
for exe in /usr/sbin/slurmctld /usr/sbin/slurmd /usr/bin/srun /usr/sbin/munged; do
    [ -x "$exe" ] || need=(slurmctld slurmd slurm-client munge)
done
[ ${#need[@]} -eq 0 ] && exit 0
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
