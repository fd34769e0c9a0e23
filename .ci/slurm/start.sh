#!/usr/bin/env bash
# Start a Slurm cluster of four emulated nodes (n0..n3) on this machine, as root: one munged,
# one slurmctld and four `slurmd -N nX` (Debian's build runs several slurmd on one host, each
# with real per-node SLURM_NODEID values). Waits until sinfo shows four idle nodes; prints the
# seconds that took. Leftovers of an earlier run (daemons from its pid files, its saved jobs)
# are stopped and cleared first. Clients need SLURM_CONF="$QWEN35_SLURM_DIR/etc/slurm.conf".
set -euo pipefail
here="$(dirname "$0")"
. "$here/env.sh"
started=$(date +%s%N)

[ "$(id -u)" -eq 0 ] || { echo "error: the test cluster's daemons run as root; run as root" >&2; exit 2; }
bash "$here/stop.sh"
for port in $(seq "$SLURM_PORT" $((SLURM_PORT + ${#NODES[@]}))); do
    if ss -Hltn "sport = :$port" | grep -q .; then
        echo "error: port $port is taken: set QWEN35_SLURM_PORT to a free range of 5 ports" >&2
        exit 2
    fi
done

rm -rf "$SLURM_DIR/spool" "$SLURM_DIR/log"
mkdir -p "$SLURM_DIR/etc" "$RUN_DIR" "$SLURM_DIR/log" "$SLURM_DIR/spool/ctld" "$MUNGE_DIR"
for n in "${NODES[@]}"; do mkdir -p "$SLURM_DIR/spool/$n"; done
chmod 755 "$SLURM_DIR"

# munge: a key of this cluster's own; munged refuses files that others could write.
chown munge:munge "$MUNGE_DIR"
chmod 755 "$MUNGE_DIR"  # the socket there must be reachable by every user
if [ ! -s "$MUNGE_DIR/munge.key" ]; then
    dd if=/dev/urandom of="$MUNGE_DIR/munge.key" bs=1024 count=1 status=none
fi
chown munge:munge "$MUNGE_DIR/munge.key"
chmod 400 "$MUNGE_DIR/munge.key"
rm -f "$MUNGE_DIR/munge.socket" "$MUNGE_DIR/munge.socket.lock"
runuser -u munge -- munged --socket="$MUNGE_DIR/munge.socket" --key-file="$MUNGE_DIR/munge.key" \
    --pid-file="$MUNGE_DIR/munged.pid" --log-file="$MUNGE_DIR/munged.log" \
    --seed-file="$MUNGE_DIR/munged.seed"

host=$(hostname -s)
last=$((SLURM_PORT + ${#NODES[@]}))
cat >"$SLURM_CONF" <<CONF
ClusterName=qwen35test
SlurmctldHost=$host
SlurmctldPort=$SLURM_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_DIR/munge.socket
StateSaveLocation=$SLURM_DIR/spool/ctld
SlurmdSpoolDir=$SLURM_DIR/spool/%n
SlurmctldPidFile=$RUN_DIR/slurmctld.pid
SlurmdPidFile=$RUN_DIR/slurmd-%n.pid
SlurmctldLogFile=$SLURM_DIR/log/slurmctld.log
SlurmdLogFile=$SLURM_DIR/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
KillWait=5
NodeName=n[0-3] NodeHostname=$host NodeAddr=127.0.0.1 Port=$((SLURM_PORT + 1))-$last CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 ThreadsPerCore=1 RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF

slurmctld -f "$SLURM_CONF"
for n in "${NODES[@]}"; do slurmd -f "$SLURM_CONF" -N "$n"; done

for _ in $(seq 300); do  # up to 30 s
    if [ "$(sinfo -h -t idle -o %D 2>/dev/null)" = "${#NODES[@]}" ]; then
        ms=$((($(date +%s%N) - started) / 1000000))
        printf 'slurm test cluster up: %s idle nodes in %d.%03d s (SLURM_CONF=%s)\n' \
            "${#NODES[@]}" $((ms / 1000)) $((ms % 1000)) "$SLURM_CONF"
        exit 0
    fi
    sleep 0.1
done
echo "error: the test cluster did not show ${#NODES[@]} idle nodes within 30 s; see $SLURM_DIR/log" >&2
sinfo >&2 || true
exit 1
