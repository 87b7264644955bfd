#!/usr/bin/env bash
# A real two-node SLURM cluster on this one machine, for CI and for trying the recipes on one machine.
#
#   .ci/local_slurm.sh up       install (Debian slurm 22.05 + munge), configure, start; wait until every node
#                               is idle. Idempotent: a second `up` leaves running daemons alone; it restarts
#                               them only when the config it writes differs from the one they run with.
#   .ci/local_slurm.sh down     stop the daemons (state and config stay)
#   .ci/local_slurm.sh purge    down, then delete state, logs and config (the next `up` starts from nothing)
#   .ci/local_slurm.sh status   daemons, node states, queue
#
# Why each choice:
# - two nodes, lp-node1 and lp-node2 (LOCAL_SLURM_NODES of them), one `slurmd -N <node>` each on its
#   own port. Debian builds SLURM with multiple-slurmd support (`scontrol show config` says
#   MULTIPLE_SLURMD = Yes), so no network namespaces are needed; the per-node paths use %n. Each
#   node runs its share of a job's tasks with its own SLURM_NODEID and SLURM_LOCALID, as on a real
#   cluster, and the tasks on lp-node2 reach the rendezvous through the name SLURM gives
#   (Lightning's MASTER_ADDR is the first host of SLURM_NODELIST), so the node names must resolve:
#   they are added to /etc/hosts as 127.0.0.1 where they do not.
# - no systemd, no cgroups: munged, slurmctld and the slurmds run as plain background daemons;
#   proctrack/linuxproc and task/none need no cgroup.conf.
# - munge authentication is required (auth/none is gone in 22.05).
# - each node advertises CPUs=max(nproc, 4) with SlurmdParameters=config_overrides, so a job of 4
#   tasks per node runs on a 2-core machine (without config_overrides a node would drain as "Low CPUs").
# - no accounting database: a small `sacct` shim answers from `squeue --states=all`, so that the
#   submitit launcher sees FAILED jobs instead of waiting forever (LOCAL_SLURM_SACCT_SHIM=0 skips it).
#
# Environment: LOCAL_SLURM_NODES (default 2), LOCAL_SLURM_CPUS (per node, default max(nproc,4)),
# LOCAL_SLURM_SACCT_SHIM (default 1). Must run as root.
set -euo pipefail

ROOT=/var/lib/local-slurm
CONF=/etc/slurm/slurm.conf
SHIM=/usr/local/bin/sacct
SHIM_MARK="# local-slurm sacct shim"
HOST=$(hostname -s)
NNODES=${LOCAL_SLURM_NODES:-2}
NODES=()
for i in $(seq 1 "$NNODES"); do NODES+=("lp-node$i"); done
FIRST_PORT=17001  # lp-node<i> listens on FIRST_PORT + i - 1
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

# The config on stdout, so that `up` can compare it with the one the daemons run with.
config() {
    local mem_mb i
    mem_mb=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
    cat <<EOF
# Written by .ci/local_slurm.sh: ${NNODES} nodes on one machine (a slurmd each), no accounting, no cgroups.
ClusterName=localci
SlurmctldHost=${HOST}(127.0.0.1)
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
# advertise CPUs=${CPUS} per node even where the machine has fewer cores
SlurmdParameters=config_overrides
ReturnToService=2
# one rank dying cancels the step instead of leaving the others in a collective
KillOnBadExit=1
MailProg=/bin/true
# keep finished jobs visible to squeue (and the sacct shim) for an hour
MinJobAge=3600
# a requeued job may start again once its old credential has expired (SLURM's default: 120 s); the
# requeue tests wait for it rather than forcing an earlier start, which slurmd refuses
# ("Job credential revoked")
AuthInfo=cred_expire=10
StateSaveLocation=${ROOT}/spool/ctld
# %n is the node name: a spool folder, pid file and log per slurmd
SlurmdSpoolDir=${ROOT}/spool/d-%n
SlurmctldPidFile=${ROOT}/run/slurmctld.pid
SlurmdPidFile=${ROOT}/run/slurmd-%n.pid
SlurmctldLogFile=${ROOT}/log/slurmctld.log
SlurmdLogFile=${ROOT}/log/slurmd-%n.log
EOF
    for i in $(seq 1 "$NNODES"); do
        echo "NodeName=${NODES[i-1]} NodeAddr=127.0.0.1 NodeHostname=${HOST} Port=$(( FIRST_PORT + i - 1 ))" \
            "CPUs=${CPUS} Boards=1 SocketsPerBoard=1 CoresPerSocket=${CPUS} ThreadsPerCore=1" \
            "RealMemory=$(( mem_mb / NNODES )) State=UNKNOWN"
    done
    echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
}

# Write the config. If it changed while daemons run with another one, restart them on a fresh
# controller state: jobs and node states saved under another set of nodes mean nothing now.
write_config() {
    mkdir -p "$ROOT"/spool/ctld "$ROOT"/run "$ROOT"/log /etc/slurm
    local new
    new=$(config)
    if [ -f "$CONF" ] && [ "$new" = "$(cat "$CONF")" ]; then return; fi
    if compgen -G "$ROOT/run/slurm*.pid" >/dev/null; then
        log "the configuration changed: restarting slurmctld and the slurmds on a fresh state"
        stop_slurm
        rm -rf "${ROOT:?}"/spool/ctld/*
    fi
    printf '%s\n' "$new" > "$CONF"
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

ensure_hostnames_resolve() {
    local name
    for name in "$HOST" "${NODES[@]}"; do
        if ! getent hosts "$name" >/dev/null; then
            log "adding '127.0.0.1 $name' to /etc/hosts"
            echo "127.0.0.1 $name" >> /etc/hosts
        fi
    done
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
    local node
    pid_alive "$ROOT/run/slurmctld.pid" || slurmctld -i
    for node in "${NODES[@]}"; do
        mkdir -p "$ROOT/spool/d-$node"
        pid_alive "$ROOT/run/slurmd-$node.pid" || slurmd -N "$node"
    done
}

wait_for_idle() {
    local node state waiting=()
    for _ in $(seq 1 60); do
        waiting=()
        for node in "${NODES[@]}"; do
            state=$(sinfo --noheader --nodes="$node" --format=%T 2>/dev/null || true)
            case "$state" in
                idle*|mixed*|allocated*) ;;
                drain*|down*|inval*)
                    # a drained state saved by an earlier run survives restarts; ReturnToService does not clear it
                    scontrol update NodeName="$node" State=RESUME 2>/dev/null || true
                    waiting+=("$node:$state") ;;
                *) waiting+=("$node:${state:-unknown}") ;;
            esac
        done
        if [ ${#waiting[@]} -eq 0 ]; then
            log "nodes up: $(sinfo --noheader --format='%N %T')"
            return 0
        fi
        sleep 0.5
    done
    log "nodes not idle: ${waiting[*]}; see $ROOT/log/"
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

# every slurmd this script started (slurmd.pid is the one of the earlier one-node layout), then the controller
stop_slurm() {
    local pidfile
    for pidfile in "$ROOT"/run/slurmd*.pid; do
        if [ -e "$pidfile" ]; then stop_daemon "$pidfile"; fi
    done
    stop_daemon "$ROOT/run/slurmctld.pid"
}

up() {
    install_packages
    write_config
    write_sacct_shim
    ensure_hostnames_resolve
    start_munge
    start_slurm
    wait_for_idle
}

down() {
    stop_slurm
    if [ -s /run/munge/munged.pid ]; then stop_daemon /run/munge/munged.pid; fi
}

purge() {
    down
    rm -rf "$ROOT" "$CONF"
    if [ -e "$SHIM" ] && grep -q "$SHIM_MARK" "$SHIM"; then rm -f "$SHIM"; fi
}

status() {
    for d in munged slurmctld slurmd; do
        echo "$d: $(pgrep -c -x "$d" || true) running"
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
