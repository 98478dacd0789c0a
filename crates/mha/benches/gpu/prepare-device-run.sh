#!/usr/bin/env bash
# Builds, on a machine without a GPU, everything `device-run.sh` needs on one with a GPU, in
# a folder small enough to travel (the device tool carries at most 64 MiB):
#
#   target-device/gpu.xz                               the gpu bench, CUDA and wgpu, stripped
#   target-device/cuda/nvvm/libdevice/libdevice.10.bc  what CUDA kernels using `exp` link
#   target-device/device-run.sh                        a copy of the script that runs it
#
#   bash crates/mha/benches/gpu/prepare-device-run.sh [--rehearse]
#
# `--rehearse` then runs device-run.sh here on wgpu (lavapipe without a GPU) with one tiny
# shape, so that every step up to the GPU call has run once. Environment: CARGO_TARGET_DIR
# (default ~/.cache/burn-mha/target, as .ci/run), MHA_DEVICE_DIR (default target-device).
set -euo pipefail
cd "$(dirname "$0")/../../../.."

export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/burn-mha/target}
dir=${MHA_DEVICE_DIR:-target-device}
bash scripts/cuda-sdk.sh --libdevice

# The test command's features and CUDA: one more build of Burn, ~15 minutes on 2 cores.
# cudarc's bindings for CUDA 12.8 (no toolkit here to ask; the driver is loaded at run time).
export CUDARC_CUDA_VERSION=${CUDARC_CUDA_VERSION:-12080}
features=burn-mha/wgpu,burn-mha/cuda,train-demo/ndarray,train-demo/wgpu
cargo bench --workspace --features "$features" --bench gpu --no-run \
    --message-format=json-render-diagnostics > "$CARGO_TARGET_DIR/gpu-bench-build.json"
binary=$(grep '"executable":"[^"]*gpu-' "$CARGO_TARGET_DIR/gpu-bench-build.json" \
    | sed 's/.*"executable":"\([^"]*\)".*/\1/' | tail -n 1)
[ -x "$binary" ] || { echo "prepare-device-run.sh: no gpu bench binary built" >&2; exit 1; }

rm -rf "$dir"
mkdir -p "$dir/cuda/nvvm/libdevice"
strip -o "$dir/gpu" "$binary"
xz -T0 -6 -c "$dir/gpu" > "$dir/gpu.xz"
rm "$dir/gpu"
cp "${MHA_LIBDEVICE_DIR:-$HOME/.cache/burn-mha/cuda}/nvvm/libdevice/libdevice.10.bc" \
    "$dir/cuda/nvvm/libdevice/"
cp crates/mha/benches/gpu/device-run.sh "$dir/"
size=$(du -sm "$dir" | cut -f1)
echo "$dir: ${size} MiB (the device tool carries at most 64 MiB)"
[ "$size" -lt 64 ] || { echo "prepare-device-run.sh: $dir is too large to travel" >&2; exit 1; }

if [ "${1:-}" = "--rehearse" ]; then
    MHA_DEVICE=wgpu MHA_SHAPES=1x64x32x2 MHA_DTYPES=f32 MHA_RUNS=1 MHA_BUDGET_S=300 \
        bash "$dir/device-run.sh" "$dir" "$dir/rehearsal"
fi
