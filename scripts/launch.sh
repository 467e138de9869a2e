#!/usr/bin/env bash
# Launch a Python script on N local processes with torchrun (default) or mpiexec (--mpi).
# Run `bash scripts/launch.sh --help` for usage.
set -euo pipefail

usage() {
    cat <<'EOF'
Usage: bash scripts/launch.sh [--nproc_per_node=N | --nproc_per_node N] [--mpi [-n N]] script.py [args...]

Runs script.py on N processes per node with torchrun (`torch.distributed.run`, whose
report of a failed job becomes one line: scripts/torchrun_one_line.py), or with
`mpiexec -n N python script.py args...` when --mpi is given. Inside the script,
`disttune.dist.init()` picks up either launcher's environment.

Options (must come before script.py; everything after it goes to the script unchanged):
  --nproc_per_node=N, --nproc_per_node N
                     processes per node (also --nproc-per-node). Default: the number
                     of visible GPUs (CUDA_VISIBLE_DEVICES, `nvidia-smi -L`, or
                     torch.cuda.device_count()), or 2 on a machine without GPUs.
  --mpi              launch with mpiexec (from PATH) instead of torchrun.
  -n N, --np N       total MPI processes (with --mpi; default: processes per node).
  -h, --help         print this help and exit.
  --                 end of options (use if the script name starts with '-').

Environment:
  NNODES (1), NODE_RANK (0)      multi-node torchrun: run this on every node.
  MASTER_ADDR (127.0.0.1)        host of node 0 (torchrun).
  MASTER_PORT                    torchrun rendezvous port; default a free port on one
                                 node, 29500 with NNODES > 1 (all nodes must agree).
  PYTHON (python)                interpreter to run.
  MPIEXEC_ARGS                   extra mpiexec arguments (word-split), e.g. a hostfile.
  OMP_NUM_THREADS                default 1.
  DISTTUNE_TRACEBACK             1: every rank's traceback and torchrun's whole report.
  TRITON_INTERPRET               set to 1 where no GPU is visible (Triton's CPU interpreter),
                                 unless you exported it.
  NCCL_*                         kept as exported. NVLink multicast stays off unless
                                 you export NCCL_NVLS_ENABLE=1,
                                 TORCH_SYMM_MEM_DISABLE_MULTICAST=0, NVSHMEM_DISABLE_NVLS=0.
The repository root is prepended to PYTHONPATH so `import disttune` works uninstalled.

Examples:
  bash scripts/launch.sh examples/ag_gemm.py --M 4096 --K 4096 --N 4096
  bash scripts/launch.sh --nproc_per_node=2 tests/some_script.py "a b"
  bash scripts/launch.sh --mpi -n 4 examples/ag_gemm.py
  NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 bash scripts/launch.sh examples/ag_gemm.py
EOF
}

die() {
    echo "launch.sh: $*" >&2
    echo "Run 'bash scripts/launch.sh --help' for usage." >&2
    exit 2
}

is_pos_int() { [[ "$1" =~ ^[1-9][0-9]*$ ]]; }

nproc=""
use_mpi=0
mpi_np=""
script=""

while (($# > 0)); do
    case "$1" in
        -h | --help)
            usage
            exit 0
            ;;
        --nproc_per_node=* | --nproc-per-node=*)
            nproc="${1#*=}"
            shift
            ;;
        --nproc_per_node | --nproc-per-node)
            (($# >= 2)) || die "$1 needs a value"
            nproc="$2"
            shift 2
            ;;
        --mpi)
            use_mpi=1
            shift
            ;;
        -n | -np | --np)
            (($# >= 2)) || die "$1 needs a value"
            mpi_np="$2"
            shift 2
            ;;
        -n=* | --np=*)
            mpi_np="${1#*=}"
            shift
            ;;
        --)
            shift
            (($# > 0)) || die "no script given after --"
            script="$1"
            shift
            break
            ;;
        -*)
            die "unknown option '$1' (options go before the script; script arguments after it)"
            ;;
        *)
            script="$1"
            shift
            break
            ;;
    esac
done
# "$@" now holds the script's own arguments, untouched.

[[ -n "$script" ]] || die "no script given"
[[ -f "$script" ]] || die "script '$script' not found"
[[ -z "$nproc" ]] || is_pos_int "$nproc" || die "--nproc_per_node must be a positive integer, got '$nproc'"
[[ -z "$mpi_np" ]] || is_pos_int "$mpi_np" || die "-n must be a positive integer, got '$mpi_np'"
if [[ -n "$mpi_np" && "$use_mpi" == 0 ]]; then
    die "-n is for --mpi; with torchrun use --nproc_per_node=N"
fi

PYTHON="${PYTHON:-python}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
command -v "$PYTHON" >/dev/null 2>&1 || die "no python interpreter found (set PYTHON=...)"

count_gpus() {
    local n
    if [[ -n "${CUDA_VISIBLE_DEVICES+x}" ]]; then
        # Respect the user's mask; empty or "-1"-style values mean no GPU.
        n=$(tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -cE '^[[:space:]]*[0-9A-Za-z]' || true)
        [[ "$CUDA_VISIBLE_DEVICES" =~ ^[[:space:]]*-1 ]] && n=0
        echo "${n:-0}"
        return
    fi
    if command -v nvidia-smi >/dev/null 2>&1 && n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true) && [[ "${n:-0}" -gt 0 ]]; then
        echo "$n"
        return
    fi
    n=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0)
    echo "${n:-0}"
}

gpus=$(count_gpus)
if [[ -z "$nproc" ]]; then
    if [[ "$use_mpi" == 1 && -n "$mpi_np" ]]; then
        nproc="$mpi_np"
    else
        nproc="$gpus"
        is_pos_int "$nproc" || nproc=2
    fi
fi
# Without a GPU, Triton's kernels can only run in its interpreter, which must be chosen before triton loads.
if ! is_pos_int "$gpus" && [[ -z "${TRITON_INTERPRET:-}" ]]; then
    export TRITON_INTERPRET=1
    echo "launch.sh: no GPU here: Triton's kernels run in its CPU interpreter (TRITON_INTERPRET=1)" >&2
fi

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="${repo_root}${PYTHONPATH:+:${PYTHONPATH}}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# Never enable NVLink multicast by default; keep whatever the user exported.
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
export TORCH_SYMM_MEM_DISABLE_MULTICAST="${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}"
export NVSHMEM_DISABLE_NVLS="${NVSHMEM_DISABLE_NVLS:-1}"

if [[ "$use_mpi" == 1 ]]; then
    command -v mpiexec >/dev/null 2>&1 || die "--mpi needs 'mpiexec' on PATH (e.g. pip install mpich mpi4py)"
    np="${mpi_np:-$nproc}"
    mpi_flags=()
    mpi_version="$(mpiexec --version 2>&1 || true)"
    if [[ "$mpi_version" == *"Open MPI"* || "$mpi_version" == *"OpenRTE"* ]]; then
        mpi_flags+=(--allow-run-as-root --oversubscribe)
        # Open MPI insists on an rsh agent even for local ranks; containers often have no ssh.
        if [[ -z "${OMPI_MCA_plm_rsh_agent:-}" ]] && ! command -v ssh >/dev/null 2>&1 && ! command -v rsh >/dev/null 2>&1; then
            mpi_flags+=(--mca plm_rsh_agent false)
        fi
    fi
    extra=()
    if [[ -n "${MPIEXEC_ARGS:-}" ]]; then
        read -r -a extra <<<"$MPIEXEC_ARGS"
    fi
    exec mpiexec ${mpi_flags[@]+"${mpi_flags[@]}"} ${extra[@]+"${extra[@]}"} -n "$np" "$PYTHON" "$script" "$@"
fi

NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
is_pos_int "$NNODES" || die "NNODES must be a positive integer, got '$NNODES'"
[[ "$NODE_RANK" =~ ^[0-9]+$ ]] && ((NODE_RANK < NNODES)) || die "NODE_RANK must be in [0, NNODES), got '$NODE_RANK'"
if [[ -z "${MASTER_PORT:-}" ]]; then
    if ((NNODES > 1)); then
        MASTER_PORT=29500 # every node must compute the same port
    else
        MASTER_PORT=$("$PYTHON" -c 'import socket
s = socket.socket()
s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])' 2>/dev/null || echo $((29500 + RANDOM % 1000)))
    fi
fi

# torchrun itself, but a failed job's report is one line (scripts/torchrun_one_line.py; DISTTUNE_TRACEBACK=1: all of it)
exec "$PYTHON" "${repo_root}/scripts/torchrun_one_line.py" \
    --nnodes="$NNODES" \
    --node_rank="$NODE_RANK" \
    --nproc_per_node="$nproc" \
    --master_addr="$MASTER_ADDR" \
    --master_port="$MASTER_PORT" \
    "$script" "$@"
