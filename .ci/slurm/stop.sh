#!/usr/bin/env bash
# Stop the test cluster start.sh started: cancel its jobs, then end exactly the daemons whose
# pid files it wrote (a pid is signalled only while its command line still names this
# cluster's directory, so a pid reused by another process since is left alone).
set -uo pipefail
. "$(dirname "$0")/env.sh"

ours() {  # ours PIDFILE: print the pid recorded there if that process is still this cluster's
    local pid
    [ -f "$1" ] || return 1
    pid=$(cat "$1" 2>/dev/null) || return 1
    [[ "$pid" =~ ^[0-9]+$ ]] || return 1
    tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "$SLURM_DIR" || return 1
    echo "$pid"
}

pidfiles=("$RUN_DIR"/slurmd-*.pid "$RUN_DIR/slurmctld.pid" "$MUNGE_DIR/munged.pid")

# Jobs first, while the controller still runs, so that no task outlives its slurmd.
if pid=$(ours "$RUN_DIR/slurmctld.pid"); then
    timeout 10 scancel --full --quiet --user="$(id -un)" 2>/dev/null || true
    for _ in $(seq 50); do
        [ -z "$(timeout 5 squeue -h -o %i 2>/dev/null)" ] && break
        sleep 0.2
    done
fi

pids=()
for f in "${pidfiles[@]}"; do
    if pid=$(ours "$f"); then
        kill -TERM "$pid" 2>/dev/null && pids+=("$pid")
    fi
done
for _ in $(seq 50); do  # up to 10 s for a clean exit, then SIGKILL
    alive=()
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive+=("$pid"); done
    [ ${#alive[@]} -eq 0 ] && break
    sleep 0.2
done
for pid in "${alive[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
rm -f "${pidfiles[@]}"
exit 0
