#!/usr/bin/env bash
# Runs the whole GPU table of `benches/gpu.rs` on a machine with a GPU, from what
# `prepare-device-run.sh` built on a machine without one: every implementation (ours with Auto
# and with the flash path forced, Burn's MHA, Burn's fused op), the issue's three shapes, `fwd`
# and `fwd+bwd`, f32 and bf16, with time and peak device memory. Writes `gpu-table.md` (the
# table, the GPU's name, the date) and `gpu.txt` (everything the runs printed) into the output
# folder.
#
#   bash crates/mha/benches/gpu/device-run.sh [PREPARED_DIR] [OUTPUT_DIR]
#
# PREPARED_DIR (default target-device) holds `gpu.xz` (the bench binary) and
# `cuda/nvvm/libdevice/libdevice.10.bc`; OUTPUT_DIR defaults to $OUT (the device tool's
# folder), else PREPARED_DIR/out. Environment: MHA_DEVICE (default cuda), MHA_BUDGET_S (the
# seconds all groups may take, default 450), MHA_CELL_TIMEOUT_S (default 90), MHA_RUNS (timed
# runs per cell, default 3), MHA_SHAPES and MHA_DTYPES (to rehearse with small shapes).
#
# Groups run in the order of what matters most (bf16 training first), each bounded by what is
# left of the budget, so that a slow machine still brings the most important rows back.
set -uo pipefail

prepared=${1:-target-device}
out=${2:-${OUT:-$prepared/out}}
device=${MHA_DEVICE:-cuda}
budget=${MHA_BUDGET_S:-450}
cell_timeout=${MHA_CELL_TIMEOUT_S:-90}
runs=${MHA_RUNS:-3}
shapes=${MHA_SHAPES:-4x4096x1024x16,8x1024x1024x16,1x16384x1024x16}
dtypes=${MHA_DTYPES:-bf16,f32}
mkdir -p "$out"
log="$out/gpu.txt"
table="$out/gpu-table.md"
started=$SECONDS

bench="$prepared/gpu"
if [ -f "$prepared/gpu.xz" ]; then
    bench=$(mktemp -d)/gpu
    xz -dc "$prepared/gpu.xz" > "$bench"
    chmod +x "$bench"
fi
[ -x "$bench" ] || { echo "device-run.sh: no bench binary in $prepared" >&2; exit 2; }
if [ -f "$prepared/cuda/nvvm/libdevice/libdevice.10.bc" ]; then
    CUDA_PATH=$(cd "$prepared/cuda" && pwd)
    export CUDA_PATH
fi
# The autotuner's results, kept for the run's later cells (CubeCL writes its cache here).
export HOME=${HOME:-$out}

{
    echo "# device-run.sh, $(date -u '+%Y-%m-%d %H:%M UTC')"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null \
        || echo "(no nvidia-smi)"
    uname -srm
} > "$log"

# One bench call per group: shapes × dtypes × modes, its rows appended to the table.
run_group() {
    local dtype=$1 shape=$2 mode=$3
    local left=$((budget - (SECONDS - started)))
    if [ "$left" -lt 20 ]; then
        echo "| $device | $dtype | $shape | $mode | (budget spent: not run) | | | | |" >> "$table.rows"
        return
    fi
    echo "## $dtype $shape $mode (${left} s left)" >> "$log"
    timeout "$left" "$bench" --devices "$device" --dtypes "$dtype" --shapes "$shape" \
        --modes "$mode" --runs "$runs" --cell-timeout "$cell_timeout" \
        --implementations ours,ours-flash,burn-mha,burn-fused \
        > "$out/group.txt" 2>> "$log"
    cat "$out/group.txt" >> "$log"
    grep "^| $device " "$out/group.txt" >> "$table.rows"
}

: > "$table.rows"
IFS=, read -r -a shape_list <<< "$shapes"
IFS=, read -r -a dtype_list <<< "$dtypes"
for dtype in "${dtype_list[@]}"; do
    for mode in fwd+bwd fwd; do
        for shape in "${shape_list[@]}"; do
            run_group "$dtype" "$shape" "$mode"
        done
    done
done

{
    echo "GPU: $(sed -n 2p "$log"); $(date -u '+%Y-%m-%d'); $((SECONDS - started)) s in all."
    echo "Median of $runs runs after a warm-up, each cell in a fresh process; reserved MiB: the"
    echo "device allocator's peak reservation; the last column: the cell's time over ours (Auto)."
    echo
    echo "| device | type | batch, seq, d_model, heads | mode | implementation | ms | reserved MiB | peak RSS MiB | vs first |"
    echo "|---|---|---|---|---|---|---|---|---|"
    cat "$table.rows"
} > "$table"
rm -f "$table.rows" "$out/group.txt"
cat "$table"
