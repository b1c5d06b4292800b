#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Installs what mok needs to build and test, from Debian's (or Ubuntu's) packages.
# As root it installs what is missing; otherwise it says exactly what is.
set -eu
cd "$(dirname "$0")/.."
# needed to build and test
pkgs=(build-essential pkg-config libuv1-dev libprotobuf-c-dev protobuf-c-compiler
      libsystemd-dev python3 python3-numpy python3-pytest)
# wanted for the fuzzers (clang and its runtime) and unit verification (systemd)
extras=(clang systemd)

installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
missing_of() { local p; for p in "$@"; do installed "$p" || echo "$p"; done; }

install_pkgs() { # names...; as root
  export DEBIAN_FRONTEND=noninteractive
  [ -n "${apt_updated:-}" ] || { apt-get update -qq; apt_updated=1; }
  apt-get install -y -qq --no-install-recommends "$@"
}

mapfile -t missing < <(missing_of "${pkgs[@]}")
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "setup: missing Debian packages: ${missing[*]}" >&2
    echo "setup: run as root, or: sudo apt-get install ${missing[*]}" >&2
    exit 1
  fi
  echo "setup: installing ${missing[*]}"
  install_pkgs "${missing[@]}"
fi

# extras: best effort; the fuzzers need clang's runtime of the same version
mapfile -t missing < <(missing_of "${extras[@]}")
if [ ${#missing[@]} -gt 0 ] && [ "$(id -u)" -eq 0 ]; then
  install_pkgs "${missing[@]}" || echo "setup: could not install ${missing[*]} (fuzzers or unit checks will be skipped)"
fi
if command -v clang >/dev/null 2>&1; then
  v=$(clang -dumpversion | cut -d. -f1)
  if ! installed "libclang-rt-$v-dev"; then
    if [ "$(id -u)" -eq 0 ]; then
      install_pkgs "libclang-rt-$v-dev" || echo "setup: no libclang-rt-$v-dev: the fuzzers cannot link"
    else
      echo "setup: for the fuzzers, install libclang-rt-$v-dev" >&2
    fi
  fi
fi
echo "setup: build and test dependencies are installed"
if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  # the pinned CUTLASS headers the grouped GEMMs build on (kernels/cutlass_gemm/),
  # downloaded by pip from the package index
  if ! python3 -m pip --version >/dev/null 2>&1; then
    if [ "$(id -u)" -eq 0 ]; then
      install_pkgs python3-pip
    else
      echo "setup: CUTLASS's headers come through pip: sudo apt-get install python3-pip" >&2
      exit 1
    fi
  fi
  deploy/cutlass.sh
  echo "setup: nvcc found: the CUDA parts will build"
else
  echo "setup: no nvcc: the CUDA parts are skipped (the cpu engine runs everywhere)"
fi
