#!/usr/bin/env bash
# A throwaway one-node Slurm cluster on this machine, for tests/test_slurm.py and for trying
# scripts/slurm/*.sbatch on a laptop. It installs nothing: it needs Debian's (or your
# distribution's) slurm-wlm and munge packages, and runs as root (SlurmUser=root).
#
#   tests/slurm/cluster.sh up [DIR]    write DIR/slurm.conf (default: a new folder under
#                                      $TMPDIR), start munged, slurmctld and slurmd on
#                                      localhost, wait until the node is idle, then print
#                                      `export SLURM_CONF=DIR/slurm.conf` for the clients
#   tests/slurm/cluster.sh down DIR    stop the daemons that `up DIR` started (by their pid
#                                      files in DIR, nothing else) and cancel its jobs
#
# Everything (munge key, socket, Slurm state, spool, logs) lives in DIR, never in /etc or /var.
# The node has as many CPUs as this machine, at least 2 (CPUS=N to change it), no GPUs; one
# partition `debug`, the default, without a time limit.
set -euo pipefail

die() {
    echo "error: $*" >&2
    exit 1
}

usage() {
    sed -n '2,16s/^# \{0,1\}//p' "$0"
}

need_binaries() {
    local missing=() bin
    for bin in munged mungekey slurmctld slurmd sbatch srun scontrol sinfo; do
        command -v "$bin" >/dev/null || [[ -x /usr/sbin/$bin ]] || missing+=("$bin")
    done
    ((${#missing[@]} == 0)) ||
        die "missing ${missing[*]}: install Slurm and munge first, e.g. on Debian/Ubuntu
    sudo apt-get install slurm-wlm munge
(the test cluster then runs with its own config and state; nothing in /etc is used)"
    ((EUID == 0)) || die "the test cluster runs its daemons as root (SlurmUser=root): run it as root"
}

PATH=$PATH:/usr/sbin:/sbin

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# alive PIDFILE NAME: the pid in PIDFILE if that process is still NAME
alive() {
    local pid
    [[ -s $1 ]] || return 1
    pid=$(<"$1")
    [[ $pid =~ ^[0-9]+$ && -r /proc/$pid/comm && $(<"/proc/$pid/comm") == "$2" ]] || return 1
    echo "$pid"
}

stop() {  # DIR: the daemons started by `up DIR`, newest first
    local dir=$1 name pid i
    if [[ -f $dir/slurm.conf ]] && alive "$dir/slurmctld.pid" slurmctld >/dev/null; then
        export SLURM_CONF=$dir/slurm.conf  # its jobs end first, so that no job process outlives it
        scancel --quiet --full --user root 2>/dev/null || true
        for ((i = 0; i < 300; i++)); do  # up to 30 s
            [[ -z $(squeue --noheader --format %i 2>/dev/null | head -n 1) ]] && break
            sleep 0.1
        done
    fi
    for name in slurmd slurmctld munged; do
        pid=$(alive "$dir/$name.pid" "$name") || continue
        kill -TERM "$pid"
        for ((i = 0; i < 100; i++)); do  # up to 10 s, then SIGKILL
            [[ -d /proc/$pid ]] || break
            sleep 0.1
        done
        if [[ -d /proc/$pid ]]; then
            kill -KILL "$pid" 2>/dev/null || true
        fi
        rm -f "$dir/$name.pid"
    done
}

up() {
    need_binaries
    local dir=${1:-} host cpus ctld_port slurmd_port i
    if [[ -z $dir ]]; then
        dir=$(mktemp -d "${TMPDIR:-/tmp}/slurm-test.XXXXXX")
    fi
    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd)
    [[ ! -e $dir/slurmctld.pid ]] || ! alive "$dir/slurmctld.pid" slurmctld >/dev/null ||
        die "a test cluster is already running in $dir (tests/slurm/cluster.sh down $dir)"
    chmod 0700 "$dir"  # munged refuses a socket or key in a folder others can write to
    mkdir -p "$dir/munge" "$dir/state" "$dir/spool"
    chmod 0700 "$dir/munge"
    host=$(hostname -s)
    cpus=${CPUS:-$(nproc --all)}  # --all: nproc alone follows OMP_NUM_THREADS
    ((cpus >= 2)) || cpus=2  # two tasks must fit (config_overrides below trusts the count)
    ctld_port=$(free_port) slurmd_port=$(free_port)
    while [[ $slurmd_port == "$ctld_port" ]]; do slurmd_port=$(free_port); done

    # munge: a fresh key only this cluster uses
    [[ -f $dir/munge/munge.key ]] || mungekey --create --keyfile="$dir/munge/munge.key" --bits=1024
    chmod 0400 "$dir/munge/munge.key"
    munged --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.socket" \
        --pid-file="$dir/munged.pid" --log-file="$dir/munged.log" --seed-file="$dir/munge/munged.seed"

    cat >"$dir/slurm.conf" <<CONF
# written by tests/slurm/cluster.sh: a one-node test cluster, state and logs in this folder
ClusterName=linformer-test
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# cred_expire: also how long a requeued job waits before it may start again (default 120 s)
AuthInfo=socket=$dir/munge/munge.socket,cred_expire=5
CredType=cred/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# no cgroups: plain process tracking, no task containment or accounting
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
JobRequeue=1
KillWait=5
MinJobAge=3600
InactiveLimit=0
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF
    export SLURM_CONF=$dir/slurm.conf
    slurmctld -c -f "$SLURM_CONF"  # -c: no jobs carried over from an earlier cluster here
    slurmd -f "$SLURM_CONF"
    for ((i = 0; i < 300; i++)); do  # up to 30 s for slurmd to register
        if [[ $(sinfo --noheader --nodes "$host" --format %t 2>/dev/null) == idle ]]; then
            echo "test cluster up in $dir: $(sinfo --noheader --format '%P %D node %N, %c CPUs, %t')"
            echo "export SLURM_CONF=$SLURM_CONF"
            return
        fi
        sleep 0.1
    done
    echo "the node did not come up; the logs:" >&2
    tail -n 20 "$dir"/*.log >&2 || true
    stop "$dir"
    die "test cluster in $dir failed to start"
}

case ${1:-} in
    up) up "${2:-}" ;;
    down)
        [[ -n ${2:-} && -f $2/slurm.conf ]] || die "usage: $0 down DIR (the folder \`up\` printed)"
        stop "$2"
        echo "test cluster in $2 stopped" ;;
    -h | --help) usage ;;
    *) usage >&2; exit 2 ;;
esac
