# shellcheck shell=bash disable=SC2034  # the variables set here are read by the scripts that source it
# Sourced by scripts/pretrain.sh and scripts/finetune.sh: their shared options, the batch
# arithmetic (linformer_tools/launch.py) and the fairseq-hydra-train command they print or run.

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
GPUS='' NODES=1 CPU=0 BATCH_SIZE='' GLOBAL_BATCH='' SAVE_DIR='' DRY_RUN=0 PORT=''
OVERRIDES=()

COMMON_HELP="  --gpus N            GPUs per node (default: all visible ones)
  --cpu               train on the CPU (smoke runs; fp32, add common.bf16=true for bf16): one
                      process, or under Slurm one gloo rank per task (scripts/slurm/pretrain.sbatch
                      --cpu, e.g. sbatch --ntasks-per-node 2 --gpus-per-node 0)
  --batch-size B      sequences per GPU per step (default: the config's dataset.batch_size)
  --global-batch G    sequences per update (default: the config's, e.g. 2048 for pretraining);
                      update_freq = G / (B x world size) must be a whole number
  --save-dir DIR      checkpoints, hydra_train.log, tensorboard/ and .hydra/ go here; relaunching
                      with the same DIR resumes from DIR/checkpoint_last.pt (or, if that file
                      is incomplete, from the newest complete checkpoint in DIR)
  --dry-run           print the plan (world size, ranks, threads, update_freq, paths) and the
                      exact command, run nothing
  OMP_NUM_THREADS     CPU threads per rank (default: the CPUs of the process that starts the
                      ranks, split among them: under Slurm its task's --cpus-per-task, else the
                      cores it may use; at most those cores, at least 1); a value you export
                      is kept
  -h, --help          this help
  OVERRIDE ...        hydra overrides for fairseq-hydra-train, e.g. optimization.max_update=1000
                      (+run_config=local, model.encoder_layers=2, common.bf16=true, ...)"

die() {
    echo "error: $*" >&2
    exit 2
}

positive_int() {  # NAME VALUE: VALUE must be a whole number >= 1
    [[ $2 =~ ^[1-9][0-9]*$ ]] || die "$1 needs a whole number >= 1, got '$2'"
}

# hydra reads an unquoted value with ',' or '=' as a list or worse: quote paths
hydra_quote() {
    local escaped=${1//\\/\\\\}
    printf "'%s'" "${escaped//\'/\\\'}"
}

# common_option ARGS...: if $1 is a shared option, take it and set CONSUMED to the words used
common_option() {
    case $1 in
        --gpus | --nodes | --batch-size | --global-batch | --distributed-port)
            (($# >= 2)) || die "$1 needs a value"
            positive_int "$1" "$2"
            case $1 in
                --gpus) GPUS=$2 ;; --nodes) NODES=$2 ;; --batch-size) BATCH_SIZE=$2 ;;
                --global-batch) GLOBAL_BATCH=$2 ;; --distributed-port) PORT=$2 ;;
            esac
            CONSUMED=2 ;;
        --save-dir)
            (($# >= 2)) || die "$1 needs a value"
            SAVE_DIR=$2 CONSUMED=2 ;;
        --cpu) CPU=1 CONSUMED=1 ;;
        --dry-run) DRY_RUN=1 CONSUMED=1 ;;
        -*) die "unknown option $1 (see --help)" ;;
        *) return 1 ;;
    esac
}

set_world_size() {
    if ((CPU)); then  # GPUS: processes (gloo ranks) per node
        GPUS=${GPUS:-1}
        WORLD=$((NODES * GPUS))
        if ((WORLD > 1)) && ! ((DRY_RUN)); then
            [[ -n ${SLURM_JOB_ID:-} && -n $PORT ]] ||
                die "--cpu runs one process outside Slurm: drop --gpus/--nodes, or run CPU ranks with sbatch --ntasks-per-node N --gpus-per-node 0 scripts/slurm/pretrain.sbatch --cpu ..."
        fi
        # with one task per node, fairseq's Slurm init takes the ranks per node from the GPU count
        ((WORLD == 1 || GPUS > 1)) ||
            die "--cpu on $NODES nodes needs 2 or more tasks per node (sbatch --ntasks-per-node N)"
        return
    fi
    if [[ -z $GPUS ]]; then
        GPUS=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')
        ((GPUS > 0)) || die "no GPU visible: pass --gpus N, or --cpu for a CPU smoke run"
    fi
    if ((NODES > 1)) && ! ((DRY_RUN)); then  # one process per GPU on every node: srun's job
        [[ -n ${SLURM_JOB_ID:-} && -n $PORT ]] ||
            die "--nodes $NODES needs srun and --distributed-port: use scripts/slurm/pretrain.sbatch"
    fi
    WORLD=$((NODES * GPUS))
}

# set_threads: OMP_NUM_THREADS, each rank's share of the CPUs it runs on, unless the caller set it.
# Each process's torch (and MKL) otherwise starts one thread per core of the node, so N ranks on a
# node run N x cores threads for their CPU-side work, which starves the processes that feed the
# GPUs (fairseq issue #3342: OMP_NUM_THREADS=1 took 8 GPUs from ~30% to 97-100% busy).
# The share depends on who starts the ranks, which fairseq's init decides as here: under Slurm,
# more than one task per node means srun starts this script once per rank, and one task per node
# means this process starts all the node's ranks, which then share the task's CPUs.
THREADS_NOTE=''
set_threads() {
    local cores cpus source shape tasks_per_node=1 ranks=$GPUS
    if [[ -n ${OMP_NUM_THREADS:-} ]]; then
        THREADS_NOTE="OMP_NUM_THREADS=$OMP_NUM_THREADS per rank (yours, kept)"
        return
    fi
    # the CPUs this process may run on (its affinity: Slurm's binding, taskset). GNU nproc would
    # also lower the count to OMP_THREAD_LIMIT, a limit per process, not per node
    cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
    if [[ -n ${SLURM_CPUS_PER_TASK:-} || -n ${SLURM_CPUS_ON_NODE:-} ]]; then
        if [[ -n ${SLURM_NTASKS_PER_NODE:-} ]]; then
            tasks_per_node=$SLURM_NTASKS_PER_NODE
        elif [[ -n ${SLURM_NTASKS:-} ]]; then
            tasks_per_node=$((SLURM_NTASKS / ${SLURM_NNODES:-1}))
        fi
        if ((tasks_per_node > 1)); then
            ranks=1 shape="one Slurm task per rank ($tasks_per_node on the node)"
        else
            shape="one Slurm task, starting the node's $GPUS rank(s) itself"
        fi
        if [[ -n ${SLURM_CPUS_PER_TASK:-} ]]; then
            cpus=$SLURM_CPUS_PER_TASK source="its --cpus-per-task $SLURM_CPUS_PER_TASK"
        elif ((tasks_per_node > 1)); then
            cpus=$((SLURM_CPUS_ON_NODE / tasks_per_node))
            source="its $cpus of the node's $SLURM_CPUS_ON_NODE CPUs (SLURM_CPUS_ON_NODE)"
        else
            cpus=$SLURM_CPUS_ON_NODE
            source="the node's $cpus CPUs (SLURM_CPUS_ON_NODE)"
        fi
    else
        cpus=$cores shape="no Slurm" source="the $cores core(s) this process may use"
    fi
    # Slurm's counts are what the job asked for: a task that is bound to fewer CPUs (a step started
    # with a smaller srun -c, an srun that does not pass on --cpus-per-task) runs on those only
    if ((cpus > cores)); then
        cpus=$cores source+=" capped at the $cores core(s) this process may use"
    fi
    OMP_NUM_THREADS=$((cpus / ranks > 1 ? cpus / ranks : 1))
    ((ranks == 1)) || source+=" / $ranks rank(s)"
    THREADS_NOTE="OMP_NUM_THREADS=$OMP_NUM_THREADS per rank ($shape: $source; set OMP_NUM_THREADS to choose)"
    export OMP_NUM_THREADS
}

print_plan() {  # WORLD BATCH UPDATE_FREQ GLOBAL_BATCH
    if ((CPU && $1 == 1)); then
        echo "plan: CPU, world size 1 (rank 0)"
    else
        if ((CPU)); then
            echo "plan: CPU (gloo), $NODES node(s) x $GPUS process(es) = world size $1"
        else
            echo "plan: $NODES node(s) x $GPUS GPU(s) = world size $1"
        fi
        local node
        for ((node = 0; node < NODES; node++)); do
            echo "  node $node: ranks $((node * GPUS))-$((node * GPUS + GPUS - 1))"
        done
    fi
    echo "threads: $THREADS_NOTE"
    echo "batch: $2 sequences per GPU x update_freq $3 x world size $1 = global batch $4"
    local note
    for note in "${PLAN_NOTES[@]}"; do
        echo "  $note"
    done
    echo "save dir: $SAVE_DIR (hydra_train.log, tensorboard/, .hydra/)"
    if [[ -n $RESUME_NOTE ]]; then
        echo "$RESUME_NOTE"
    fi
    if [[ -n $RESUME ]]; then
        echo "resume: from $RESUME"
    fi
}

# launch CONFIG_DIR CONFIG: plan the run, then print and (unless --dry-run) run the training.
# The plan is one Python (importing fairseq takes seconds): where the run resumes in SAVE_DIR
# (RESUME: SAVE_DIR/checkpoint_last.pt if it loads, else the newest complete checkpoint, with
# RESUME_NOTE saying why; none for a fresh start), and with FROM set, the model FROM holds and
# its weights to start from (a relaunch continues its own run, optimizer and all), then OVERRIDES
# and the batch arithmetic. BLOCKS_OF_MODEL_LENGTH=1: pretraining blocks of FROM's max_positions.
# LP_FT=first|mean (finetune.sh --lp-ft): training starts from PROBED, FROM with the head of a
# linear probe of FROM's features of DATA, fitted here first unless PROBED exists or the run resumes.
FROM='' BLOCKS_OF_MODEL_LENGTH=0 RESUME='' RESUME_NOTE='' PLAN_NOTES=() LP_FT='' PROBED='' PROBE=''
launch() {
    local config_dir=$1 config=$2 answer line batch update_freq global_batch flags=() probe_cmd=() truncation head_tokens
    local chunk_length max_positions
    set_world_size
    set_threads
    SAVE_DIR=$(realpath -m "$SAVE_DIR")  # every node and rank must see the same path
    if [[ -n $FROM ]]; then
        [[ -f $FROM ]] || die "checkpoint $FROM does not exist"
        flags+=(--from "$(realpath "$FROM")")
    fi
    if [[ -n $LP_FT ]]; then
        PROBED=$SAVE_DIR/probed.pt
        flags+=(--lp-ft "$LP_FT" --probed "$PROBED")
    fi
    ((BLOCKS_OF_MODEL_LENGTH)) && flags+=(--blocks-of-model-length)
    ((DRY_RUN)) && flags+=(--dry-run)
    answer=$("$PYTHON" -m linformer_tools.launch plan "$config_dir" "$config" "${OVERRIDES[@]}" \
        --world-size "$WORLD" --save-dir "$SAVE_DIR" "${flags[@]}" \
        ${BATCH_SIZE:+--batch-size "$BATCH_SIZE"} ${GLOBAL_BATCH:+--global-batch "$GLOBAL_BATCH"})
    OVERRIDES=()
    while IFS= read -r line; do
        case ${line%% *} in
            override) OVERRIDES+=("${line#* }") ;;
            batch) read -r batch update_freq global_batch <<<"${line#* }" ;;
            note) PLAN_NOTES+=("${line#* }") ;;
            resume) RESUME=${line#* } ;;
            resume_note) RESUME_NOTE=${line#* } ;;
            probe) PROBE=${line#* } ;;
        esac
    done <<<"$answer"
    if [[ -n $PROBE ]]; then
        read -r truncation head_tokens chunk_length max_positions <<<"$PROBE"
        probe_cmd=("$PYTHON" "$REPO/scripts/probe_head.py" "$(realpath "$FROM")" --data "$DATA" --out "$PROBED.partial"
            --pooler-tokens "$LP_FT" --truncation "$truncation" --truncation-head-tokens "$head_tokens")
        ((chunk_length)) && probe_cmd+=(--chunk-length "$chunk_length" --max-positions "$max_positions")
        ((CPU)) && probe_cmd+=(--device cpu)
        ((${SLURM_NTASKS:-1} == 1)) || ((DRY_RUN)) ||  # srun starts this script once a rank
            die "--lp-ft in a job of ${SLURM_NTASKS} tasks: each would fit the probe. Fit it once first, then relaunch: $(printf '%q ' "${probe_cmd[@]}") && mv $(printf '%q' "$PROBED.partial") $(printf '%q' "$PROBED")"
    fi

    local cmd=("$PYTHON" -m fairseq_cli.hydra_train --config-dir "$config_dir" --config-name "$config"
        "common.user_dir=$(hydra_quote "$REPO/linformer_fairseq")"
        "checkpoint.save_dir=$(hydra_quote "$SAVE_DIR")"
        "dataset.batch_size=$batch" "optimization.update_freq=[$update_freq]"
        "distributed_training.distributed_world_size=$WORLD")
    if ((CPU)); then
        cmd+=(common.cpu=true common.fp16=false)
        if ((WORLD > 1)); then  # fairseq's Slurm init places the ranks; gloo instead of NCCL
            cmd+=(distributed_training.distributed_backend=gloo distributed_training.ddp_backend=legacy_ddp)
        fi
    fi
    if [[ -n $PORT ]]; then
        cmd+=("distributed_training.distributed_port=$PORT")
    fi
    if ((WORLD > 1)); then
        # every rank reads the checkpoint it resumes from. Without this, rank 0 sends its copy to
        # the others through torch.load(weights_only=True), which rejects the placeholders fairseq
        # leaves for tensors (fairseq.distributed.utils._TensorPlaceholder; tests/test_slurm.py's
        # requeue test fails that way, 2026-11-25) even though the config types are allow-listed
        cmd+=(checkpoint.load_checkpoint_on_all_dp_ranks=true)
    fi
    cmd+=("${OVERRIDES[@]}")

    if [[ ${SLURM_PROCID:-0} == 0 ]]; then  # under srun, one copy of the plan is enough
        print_plan "$WORLD" "$batch" "$update_freq" "$global_batch"
        if ((${#probe_cmd[@]})); then
            echo "lp-ft: first a linear probe of the features ($LP_FT): $(printf '%q ' "${probe_cmd[@]}")"
        elif [[ -n $LP_FT && -z $RESUME ]]; then
            echo "lp-ft: starting from $PROBED (fitted by an earlier launch)"
        fi
        echo "command: $(printf '%q ' "${cmd[@]}")"
    fi
    if ((DRY_RUN)); then
        return
    fi
    mkdir -p "$SAVE_DIR"
    if ((${#probe_cmd[@]})); then  # written aside and moved: a cut-short probe is never started from
        "${probe_cmd[@]}" || die "the linear probe for --lp-ft failed (above)"
        mv "$PROBED.partial" "$PROBED"
    fi
    if ((CPU && WORLD > 1)); then
        # fairseq's Slurm init takes device_id from SLURM_LOCALID and would select that CUDA
        # device; a CPU rank has none (its rank still comes from SLURM_PROCID)
        SLURM_LOCALID=0 exec "${cmd[@]}"
    fi
    exec "${cmd[@]}"
}
