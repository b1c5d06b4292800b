#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Builds the NCCL group test (tests/gpu/test_nccl_group.cu) into .devbuild/nccl/
# (git-ignored) for the GPU machine: the kernels library through the Makefile's
# own rules (as `make gpu`), daemon/cuda/nccl.c with the daemon's warnings
# (with and without CUDA), and a fake libnccl.so.2 whose ncclGetVersion says
# 2.27.3 (the "too old" check). Needs nvcc and NCCL's headers (nccl.h,
# nccl_device.h) where nvcc finds them; needs no GPU and no libnccl: NCCL is
# loaded at run time. Then carry .devbuild to the GPU machine and run
# tests/gpu/run_nccl_tests.sh there.
set -euo pipefail
cd "$(dirname "$0")/../.."
B=${MOK_NCCL_BUILD:-.devbuild/nccl}
NVCC=${NVCC:-/usr/local/cuda/bin/nvcc}
CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$NVCC")")}
mkdir -p "$B/fake_old"
WARN="-Wall -Wextra -Werror -Wshadow -Wno-unused-parameter -Wstrict-prototypes"
CF="-std=c11 -D_GNU_SOURCE -pthread -fPIC -O2 -g $WARN -Iproto -Ikernels -Idaemon"

make -j"$(nproc)" BUILD="$B/mk" NVCC="$NVCC" "$B/mk/lib/libmokkernels.a"
gcc $CF -c daemon/cuda/nccl.c -o "$B/nccl_group_nocuda.o"   # the build without CUDA compiles too
gcc $CF -DMOK_HAVE_CUDA=1 -I"$CUDA_HOME/include" -c daemon/cuda/nccl.c -o "$B/nccl_group.o"
"$NVCC" -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -Iproto -Ikernels -Idaemon -Itests/gpu \
  -o "$B/test_nccl_group" tests/gpu/test_nccl_group.cu "$B/nccl_group.o" "$B/mk/lib/libmokkernels.a" \
  -ldl -lpthread
# no link-time NCCL: the program must not need libnccl
if readelf -d "$B/test_nccl_group" | grep -qi nccl; then
  echo "test_nccl_group links NCCL at build time" >&2
  exit 1
fi
cat >"$B/fake_old/fake_nccl.c" <<'C'
int ncclGetVersion(int *v) { *v = 22703; return 0; }
C
gcc -shared -fPIC -o "$B/fake_old/libnccl.so.2" "$B/fake_old/fake_nccl.c"
echo "built $B/test_nccl_group"
