# Settings shared by start.sh and stop.sh (sourced). Everything the test cluster owns lives in
# one directory, so that it neither reads nor touches a system Slurm or munge on the machine:
# its own slurm.conf (clients find it through SLURM_CONF), munge key and socket, state, logs
# and pid files, and ports of its own (QWEN35_SLURM_PORT for the controller, the next four
# for the four slurmd).
SLURM_DIR="${QWEN35_SLURM_DIR:-/tmp/qwen35-reshard-slurm}"
SLURM_PORT="${QWEN35_SLURM_PORT:-16900}"
NODES=(n0 n1 n2 n3)
export SLURM_CONF="$SLURM_DIR/etc/slurm.conf"
MUNGE_DIR="$SLURM_DIR/munge"
RUN_DIR="$SLURM_DIR/run"
export PATH="$PATH:/usr/sbin:/sbin"  # slurmctld, slurmd, munged: not on every root PATH
