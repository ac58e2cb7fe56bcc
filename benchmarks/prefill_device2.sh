#!/bin/bash
# Wave-8 second device run of the prefill GEMM variants (one H100, < 200 s): run 1 had L1 (words
# and scales through L1, with a smaller shared-memory carveout) win 11-13% where KW (the same L2
# bytes, no carveout) won 2-3%: is it the carveout? Its variants here: the carveout alone (c) and
# with KW=2, L1 with SILU, the 1K / 2K bands with L1 or the carveout, and two CTAs an SM (r: a
# 128-register cap) for 64x256 and 32x256; 128x256 on 16 warps (four warpgroups, 128 registers).
# Checks first (small shapes, K2 layers at T=64 / 2048), then one K2 layer at T=1K..16K (uniform;
# 8K and 1K also one-third routing); full output in $OUT/prefill_gemm2.txt.
cd "$(dirname "$0")/.." || exit 1
. benchmarks/device_env.sh  # PYTHONPATH, OUT, unbuffered output
timeout 196 python3 benchmarks/prefill_device.py --name prefill_gemm2 --budget 186 \
  --variants 128x256s3w8hl,128x256s3w8hc,128x256s3w8hwwc,128x256s3w8hlg,128x256s3w16hl,128x256s3w16hwwc,32x512s3w16hwwc,64x256s4w8hl,64x256s4w8hwwgc,64x256s3w8hr,32x256s4w8hr \
  --ts 8192,4096,16384,2048,1024 --third-ts 8192,1024 --layer-ts 64,2048 "$@"
