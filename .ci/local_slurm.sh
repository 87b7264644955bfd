#!/usr/bin/env bash
# A real single-node SLURM on localhost, for CI and for trying the recipes on one machine.
#
#   .ci/local_slurm.sh up       install (Debian slurm 22.05 + munge), configure, start; wait until the node is idle
#   .ci/local_slurm.sh down     stop the daemons (state and config stay)
#   .ci/local_slurm.sh purge    down, then delete state, logs and config (the next `up` starts from nothing)
#   .ci/local_slurm.sh status   daemons, node state, queue
#
# Why each choice:
# - no systemd, no cgroups: munged, slurmctld and slurmd run as plain background daemons;
#   proctrack/linuxproc and task/none need no cgroup.conf.
# - munge authentication is required (auth/none is gone in 22.05).
# - the node advertises CPUs=max(nproc, 4) with SlurmdParameters=config_overrides, so a 4-task
#   job runs on a 2-core machine (without config_overrides the node would drain as "Low CPUs").
# - no accounting database: a small `sacct` shim answers from `squeue --states=all`, so that the
#   submitit launcher sees FAILED jobs instead of waiting forever (LOCAL_SLURM_SACCT_SHIM=0 skips it).
# - the node name ends up as MASTER_ADDR, so it must resolve: it is added to /etc/hosts if needed.
#
# Environment: LOCAL_SLURM_NODENAME (default: short hostname), LOCAL_SLURM_CPUS (default max(nproc,4)),
# LOCAL_SLURM_SACCT_SHIM (default 1). Must run as root.
set -euo pipefail

ROOT=/var/lib/local-slurm
CONF=/etc/slurm/slurm.conf
SHIM=/usr/local/bin/sacct
SHIM_MARK="# local-slurm sacct shim"
NODE=${LOCAL_SLURM_NODENAME:-$(hostname -s)}
CPUS=${LOCAL_SLURM_CPUS:-$(( $(nproc) > 4 ? $(nproc) : 4 ))}

log() { echo "[local_slurm] $*" >&2; }

install_packages() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sinfo >/dev/null \
        && command -v munged >/dev/null; then
        return
    fi
    log "installing slurmctld slurmd slurm-client munge"
    # Without systemd the packages' init scripts must not try to start daemons that have no
    # config yet: a policy-rc.d that exits 101 forbids it for the duration of the install.
    local guard=""
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
        chmod +x /usr/sbin/policy-rc.d
        guard=/usr/sbin/policy-rc.d
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
    if [ -n "$guard" ]; then rm -f "$guard"; fi
}

write_config() {
    mkdir -p "$ROOT"/spool/ctld "$ROOT"/spool/d "$ROOT"/run "$ROOT"/log /etc/slurm
    local mem_mb
    mem_mb=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
    cat > "$CONF" <<EOF
# Written by .ci/local_slurm.sh: one node on localhost, no accounting, no cgroups.
ClusterName=localci
SlurmctldHost=${NODE}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# advertise CPUs=${CPUS} even where the machine has fewer cores
SlurmdParameters=config_overrides
ReturnToService=2
# one rank dying cancels the step instead of leaving the others in a collective
KillOnBadExit=1
MailProg=/bin/true
# keep finished jobs visible to squeue (and the sacct shim) for an hour
MinJobAge=3600
StateSaveLocation=${ROOT}/spool/ctld
SlurmdSpoolDir=${ROOT}/spool/d
SlurmctldPidFile=${ROOT}/run/slurmctld.pid
SlurmdPidFile=${ROOT}/run/slurmd.pid
SlurmctldLogFile=${ROOT}/log/slurmctld.log
SlurmdLogFile=${ROOT}/log/slurmd.log
NodeName=${NODE} NodeAddr=127.0.0.1 NodeHostname=${NODE} CPUs=${CPUS} Boards=1 SocketsPerBoard=1 CoresPerSocket=${CPUS} ThreadsPerCore=1 RealMemory=${mem_mb} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
}

write_sacct_shim() {
    if [ "${LOCAL_SLURM_SACCT_SHIM:-1}" = "0" ]; then return; fi
    if [ -e "$SHIM" ] && ! grep -q "$SHIM_MARK" "$SHIM"; then
        log "$SHIM exists and is not ours; leaving it alone"
        return
    fi
    # submitit polls `sacct -o JobID,State,NodeList --parsable2 -j ID[,ID...]`; answer the same
    # columns (header first, '|'-separated) from squeue, which sees finished jobs for MinJobAge.
    cat > "$SHIM" <<'EOF'
#!/usr/bin/env bash
# local-slurm sacct shim: answers `sacct -j IDS` from `squeue --states=all` (no accounting database).
jobs=""
while [ $# -gt 0 ]; do
    case "$1" in
        -j|--jobs) jobs="$2"; shift 2 ;;
        --jobs=*) jobs="${1#--jobs=}"; shift ;;
        *) shift ;;
    esac
done
echo "JobID|State|NodeList"
args=(--states=all --noheader --format='%i|%T|%N')
if [ -n "$jobs" ]; then args+=(--jobs="$jobs"); fi
squeue "${args[@]}" 2>/dev/null | sed 's/ *$//'
exit 0
EOF
    chmod +x "$SHIM"
}

ensure_hostname_resolves() {
    if ! getent hosts "$NODE" >/dev/null; then
        log "adding '127.0.0.1 $NODE' to /etc/hosts"
        echo "127.0.0.1 $NODE" >> /etc/hosts
    fi
}

start_munge() {
    if pgrep -u munge -x munged >/dev/null; then return; fi
    if [ ! -s /etc/munge/munge.key ]; then
        mungekey --create --force
        chown munge:munge /etc/munge/munge.key
        chmod 400 /etc/munge/munge.key
    fi
    mkdir -p /run/munge
    chown munge:munge /run/munge
    runuser -u munge -- munged --force
}

pid_alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

start_slurm() {
    pid_alive "$ROOT/run/slurmctld.pid" || slurmctld -i
    pid_alive "$ROOT/run/slurmd.pid" || slurmd -N "$NODE"
}

wait_for_idle() {
    local state
    for _ in $(seq 1 60); do
        state=$(sinfo --noheader --nodes="$NODE" --format=%T 2>/dev/null || true)
        case "$state" in
            idle*|mixed*|allocated*) log "node $NODE is $state"; return 0 ;;
            drain*|down*|inval*)
                # a drained state saved by an earlier run survives restarts; ReturnToService does not clear it
                scontrol update NodeName="$NODE" State=RESUME 2>/dev/null || true ;;
        esac
        sleep 0.5
    done
    log "node $NODE did not become idle (state: ${state:-unknown}); see $ROOT/log/"
    return 1
}

stop_daemon() {
    local pidfile=$1
    if pid_alive "$pidfile"; then
        local pid
        pid=$(cat "$pidfile")
        kill "$pid"
        for _ in $(seq 1 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
    fi
    rm -f "$pidfile"
}

up() {
    install_packages
    write_config
    write_sacct_shim
    ensure_hostname_resolves
    start_munge
    start_slurm
    wait_for_idle
}

down() {
    stop_daemon "$ROOT/run/slurmd.pid"
    stop_daemon "$ROOT/run/slurmctld.pid"
    if [ -s /run/munge/munged.pid ]; then stop_daemon /run/munge/munged.pid; fi
}

purge() {
    down
    rm -rf "$ROOT" "$CONF"
    if [ -e "$SHIM" ] && grep -q "$SHIM_MARK" "$SHIM"; then rm -f "$SHIM"; fi
}

status() {
    for d in munged slurmctld slurmd; do
        if pgrep -x "$d" >/dev/null; then echo "$d: running"; else echo "$d: stopped"; fi
    done
    sinfo 2>/dev/null || true
    squeue --states=all 2>/dev/null || true
}

if [ "$(id -u)" != "0" ]; then
    echo "local_slurm.sh must run as root (it installs packages and starts daemons)" >&2
    exit 1
fi

case "${1:-}" in
    up) up ;;
    down) down ;;
    purge) purge ;;
    status) status ;;
    *) echo "usage: $0 up|down|purge|status" >&2; exit 2 ;;
esac
