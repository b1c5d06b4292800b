#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Make mok.target start one mokd per GPU this machine has, and start it.
set -eu
n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
if [ "$n" -eq 0 ]; then
  echo "enable-gpus: no GPU found by nvidia-smi" >&2
  exit 1
fi
for i in $(seq 0 $((n - 1))); do
  systemctl add-wants mok.target "mokd@$i.socket" "mokd@$i.service"
done
systemctl enable mok.target
systemctl start mok.target
echo "enable-gpus: mok.target starts mokd@0..$((n - 1))"
