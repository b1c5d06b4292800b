#!/usr/bin/env bash
# Installs what mok needs to build and test, from Debian's packages.
# As root it installs what is missing; otherwise it says exactly what is.
set -eu
# build and tests; clang + its runtime for the fuzzers; systemd for unit verification
pkgs=(build-essential pkg-config libuv1-dev libprotobuf-c-dev protobuf-c-compiler
      libsystemd-dev python3 python3-numpy python3-pytest clang libclang-rt-14-dev systemd)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all build and test dependencies are installed"
else
  if [ "$(id -u)" -ne 0 ]; then
    echo "setup: missing Debian packages: ${missing[*]}" >&2
    echo "setup: run as root, or: sudo apt-get install ${missing[*]}" >&2
    exit 1
  fi
  echo "setup: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  echo "setup: nvcc found: the CUDA parts will build"
else
  echo "setup: no nvcc: the CUDA parts are skipped (the cpu engine runs everywhere)"
fi
