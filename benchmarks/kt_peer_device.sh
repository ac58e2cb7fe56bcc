#!/usr/bin/env bash
# Issue 33's peer on the device host's CPU: one K2 MoE layer (384 INT4 experts) at 1 / 4 / 16
# tokens and a 2,048-token prompt, ours against KT-Kernel's AMX path on the same tensors, with
# the read bandwidth and torch's bf16 matmul rate measured in the same run (cpu_moe.py).
# KT-Kernel travels as its extension only (the wheel is 101 MB, over a device call's carry):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_35_x86_64 -d /tmp/ktw kt-kernel==0.7.2
#   mkdir -p .kt/site && unzip -q /tmp/ktw/kt_kernel-*.whl 'kt_kernel.libs/*' \
#     'kt_kernel/__init__.py' 'kt_kernel/_cpu_detect.py' 'kt_kernel/_kt_kernel_ext_amx*' \
#     'kt_kernel/_kt_kernel_ext_avx512_bf16*' 'kt_kernel/_kt_kernel_ext_avx2*' -d .kt/site
# (24 MB; /.kt/ in .git/info/exclude), then run with carry [".kt"]:
#   OUT=$OUT bash benchmarks/kt_peer_device.sh
set -u
OUT=${OUT:-/tmp/kt_out}
mkdir -p "$OUT"
SECS=${SECS:-170}
export PYTHONPATH=$PWD/.kt/site:${PYTHONPATH:-src}
lscpu | grep -E "Model name|^CPU\(s\)|NUMA node\(s\)|L3" >"$OUT/kt_host.txt" 2>&1
timeout "$SECS" python3 benchmarks/cpu_moe.py --iters 6 --no-old --no-dot --no-forced \
  --batches 1,4,16 --prefill 2048 >"$OUT/kt_cpu_moe.txt" 2>&1
echo "## cpu_moe with the KT-Kernel peer: rc $?" | tee -a "$OUT/kt_host.txt"
grep -vE "CPUInfer|WorkerPool|NUMA|Numa|TP MOE|Creating|per-expert|load weight" \
  "$OUT/kt_cpu_moe.txt" | tail -n 30
