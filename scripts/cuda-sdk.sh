#!/usr/bin/env bash
# Makes `--features cuda` build offline: installs the LLVM 23.1 static SDK that cubecl-cuda's
# LLVM compiler links against (CubeCL 0.11's CUDA runtime always builds `cubecl-llvm`), from
# PyPI instead of the GitHub download that its build dependency `tracel-llvm-bundler` would
# attempt, and optionally the CUDA `libdevice.10.bc` that kernels using `exp` link at run time.
#
#   bash scripts/cuda-sdk.sh              # the LLVM SDK (~92 MB download, ~1 GB unpacked)
#   bash scripts/cuda-sdk.sh --libdevice  # and libdevice, for running (not building) on a GPU
#
# How: PyPI's `mlc-llvm-static` + `mlc-llvm-static-extra-targets` 23.1.1.post0 hold LLVM 23.1's
# static libraries, headers and an `llvm-config` with the NVPTX target. The bundler's build
# script downloads nothing when its marker file exists in the directory where it would unpack
# LLVM, `${XDG_DATA_HOME:-$HOME/.local/share}/tracel/tracel-llvm-23.1.0-4`, and
# `cubecl-llvm`'s build script reads `llvm-config` from that same directory; so that directory
# becomes a link to the SDK, with the marker in it. The workspace's `cuda` features also turn on
# the bundler's `xtask` feature (`crates/workspace-hack`), which skips its download for good.
#
# Environment: MHA_LLVM_SDK (where the SDK goes; default ~/.cache/burn-mha/llvm-sdk),
# MHA_LIBDEVICE_DIR (where libdevice goes; default ~/.cache/burn-mha/cuda, laid out as a
# CUDA_PATH: nvvm/libdevice/libdevice.10.bc), XDG_DATA_HOME (as the bundler reads it).
set -euo pipefail

llvm_version=23.1.1.post0
bundle=tracel-llvm-23.1.0-4
sdk=${MHA_LLVM_SDK:-$HOME/.cache/burn-mha/llvm-sdk}
data_home=${XDG_DATA_HOME:-$HOME/.local/share}
libdevice_dir=${MHA_LIBDEVICE_DIR:-$HOME/.cache/burn-mha/cuda}

if [ ! -x "$sdk/mlc_llvm_static/static/bin/llvm-config" ]; then
    # Both wheels in one call: the second adds the NVPTX target's libraries to the first's tree.
    python3 -m pip install --quiet --no-deps --target "$sdk" \
        "mlc-llvm-static==$llvm_version" "mlc-llvm-static-extra-targets==$llvm_version"
fi
chmod +x "$sdk/mlc_llvm_static/static/bin/llvm-config"
version=$("$sdk/mlc_llvm_static/static/bin/llvm-config" --version)
case "$version" in
    23.1.*) ;;
    *) echo "cuda-sdk.sh: llvm-config says $version, not 23.1" >&2; exit 1 ;;
esac
if ! "$sdk/mlc_llvm_static/static/bin/llvm-config" --targets-built | grep -qw NVPTX; then
    echo "cuda-sdk.sh: the SDK has no NVPTX target (mlc-llvm-static-extra-targets missing)" >&2
    exit 1
fi

mkdir -p "$data_home/tracel"
link="$data_home/tracel/$bundle"
if [ -e "$link" ] && [ ! -L "$link" ]; then
    echo "cuda-sdk.sh: $link exists and is not a link; move it away first" >&2
    exit 1
fi
ln -sfn "$sdk/mlc_llvm_static/static" "$link"
touch "$link/.tracel-llvm-installed"
echo "LLVM $version at $link"

if [ "${1:-}" = "--libdevice" ]; then
    target="$libdevice_dir/nvvm/libdevice/libdevice.10.bc"
    if [ ! -f "$target" ]; then
        wheel_dir=$(mktemp -d)
        python3 -m pip install --quiet --no-deps --target "$wheel_dir" "nvidia-cuda-nvcc-cu12==12.8.*"
        mkdir -p "$(dirname "$target")"
        cp "$wheel_dir/nvidia/cuda_nvcc/nvvm/libdevice/libdevice.10.bc" "$target"
        rm -rf "$wheel_dir"
    fi
    echo "libdevice at $target (run with CUDA_PATH=$libdevice_dir)"
fi
