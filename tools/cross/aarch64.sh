#!/usr/bin/env bash
# Lints the kernels for 64-bit ARM (aarch64-unknown-linux-gnu) and runs their
# tests under qemu's user-mode emulation: every NEON path against the portable
# definition, bit for bit. With --workspace it also builds every crate for
# ARM (the kernels are the only architecture-specific code; this takes longer).
#
# Needs the Rust target, a cross linker and qemu-user; installs them when it
# can (rustup, apt-get as root or through sudo). When they cannot be had it
# says so and exits 0, unless DEEPINFER_REQUIRE_AARCH64=1.
set -euo pipefail
cd "$(dirname "$0")/../.."
target=aarch64-unknown-linux-gnu

unavailable() {
    echo "aarch64 check skipped: $1" >&2
    if [ "${DEEPINFER_REQUIRE_AARCH64:-0}" = 1 ]; then exit 1; fi
    exit 0
}

if ! rustup target list --installed 2>/dev/null | grep -qx "$target"; then
    rustup target add "$target" >/dev/null 2>&1 || unavailable "rustup cannot add $target"
fi
if ! command -v aarch64-linux-gnu-g++ >/dev/null || ! command -v qemu-aarch64 >/dev/null; then
    sudo=""
    if [ "$(id -u)" != 0 ]; then
        command -v sudo >/dev/null || unavailable "no root to install gcc-aarch64-linux-gnu and qemu-user"
        sudo="sudo -n"
    fi
    packages="gcc-aarch64-linux-gnu g++-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user"
    { $sudo apt-get install -y --no-install-recommends $packages \
        || { $sudo apt-get update && $sudo apt-get install -y --no-install-recommends $packages; }; } >/dev/null 2>&1 \
        || unavailable "apt-get cannot install $packages"
fi

export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu"
export CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc CXX_aarch64_unknown_linux_gnu=aarch64-linux-gnu-g++
cargo clippy --target "$target" -p deepinfer-kernels --all-targets -- -D warnings
if [ "${1:-}" = --workspace ]; then
    cargo check --target "$target" --workspace
fi
cargo test --release --target "$target" -p deepinfer-kernels
