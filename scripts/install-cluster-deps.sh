#!/usr/bin/env bash
# Install the cluster software that the launcher tests (tests/cluster) run for real:
#   ssh    openssh-server, openssh-client, rsync
#   mpi    openmpi-bin (mpirun; the test jobs are not MPI programs, so no libopenmpi-dev)
#   slurm  slurmctld, slurmd, slurm-client (srun/salloc/sbatch/sinfo), munge (a dependency of
#          them; the tests use Slurm 22.05's auth/none and need munged only where that is gone)
#   sge    gridengine-master, gridengine-exec, gridengine-client (Son of Grid Engine 8.1.9)
#
# Idempotent and non-interactive: it installs only the packages that are missing, says which,
# and exits 0 at once when there is nothing to do. It starts no daemon: while it runs, a
# /usr/sbin/policy-rc.d that exits 101 forbids invoke-rc.d to start services (any
# policy-rc.d that was there before is put back afterwards). Grid Engine is preseeded with
# shared/gridengineconfig=false, so its packages do not create a system-wide cell under
# /var/lib/gridengine; tests/cluster/daemons.py builds a private cell in a temporary directory.
#
# Usage: scripts/install-cluster-deps.sh [--check] [--no-sge] [ssh|mpi|slurm|sge ...]
#   no group named: all groups.  --check: only report what is missing (exit 1 if anything is).
set -euo pipefail

check_only=0
no_sge=0
groups=()
for arg in "$@"; do
    case "$arg" in
        --check) check_only=1 ;;
        --no-sge) no_sge=1 ;;
        ssh | mpi | slurm | sge) groups+=("$arg") ;;
        -h | --help)
            sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'
            exit 0
            ;;
        *)
            echo "install-cluster-deps: unknown argument: $arg" >&2
            exit 2
            ;;
    esac
done
if [ "${#groups[@]}" -eq 0 ]; then
    groups=(ssh mpi slurm sge)
fi

wanted=()
for g in "${groups[@]}"; do
    case "$g" in
        ssh) wanted+=(openssh-server openssh-client rsync) ;;
        mpi) wanted+=(openmpi-bin) ;;
        slurm) wanted+=(slurmctld slurmd slurm-client munge) ;;
        sge) [ "$no_sge" -eq 1 ] || wanted+=(gridengine-master gridengine-exec gridengine-client) ;;
    esac
done

installed() {
    [ "$(dpkg-query -W -f='${db:Status-Status}' "$1" 2>/dev/null || true)" = "installed" ]
}

missing=()
for p in "${wanted[@]}"; do
    installed "$p" || missing+=("$p")
done

if [ "${#missing[@]}" -eq 0 ]; then
    echo "install-cluster-deps: all present (${wanted[*]})"
    exit 0
fi
if [ "$check_only" -eq 1 ]; then
    echo "install-cluster-deps: missing: ${missing[*]}"
    exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-cluster-deps: missing ${missing[*]}, and there is no apt-get here; install them by hand" >&2
    exit 1
fi
SUDO=()
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        SUDO=(sudo -n)
    else
        echo "install-cluster-deps: missing ${missing[*]}; run this script as root (or with sudo)" >&2
        exit 1
    fi
fi

echo "install-cluster-deps: installing: ${missing[*]}"
start=$(date +%s)

export DEBIAN_FRONTEND=noninteractive
policy=/usr/sbin/policy-rc.d
backup=""
restore_policy() {
    if [ -n "$backup" ]; then
        "${SUDO[@]}" cp -p "$backup" "$policy"
        rm -f "$backup"
    else
        "${SUDO[@]}" rm -f "$policy"
    fi
}
if [ -e "$policy" ]; then
    backup=$(mktemp)
    cp -p "$policy" "$backup"
fi
trap restore_policy EXIT
trap 'exit 130' INT TERM
printf '#!/bin/sh\n# written by pskv scripts/install-cluster-deps.sh while it installs packages\nexit 101\n' |
    "${SUDO[@]}" tee "$policy" >/dev/null
"${SUDO[@]}" chmod 755 "$policy"

# Grid Engine: no system-wide cell (the tests build their own), no questions asked.
"${SUDO[@]}" debconf-set-selections <<'EOF'
gridengine-common shared/gridengineconfig boolean false
gridengine-common shared/gridenginecell string default
gridengine-common shared/gridenginemaster string localhost
gridengine-client shared/gridengineconfig boolean false
gridengine-master shared/gridengineconfig boolean false
gridengine-exec shared/gridengineconfig boolean false
EOF

apt_opts=(-y -q --no-install-recommends -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold)
if ! "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install "${apt_opts[@]}" "${missing[@]}"; then
    echo "install-cluster-deps: install failed; refreshing the package lists and trying again"
    "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -q
    "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install "${apt_opts[@]}" "${missing[@]}"
fi

echo "install-cluster-deps: installed ${missing[*]} in $(($(date +%s) - start))s"
