#!/usr/bin/env python
"""Raw vs dynamic-batching throughput on a GPU: small and ViT-L h1, batch 64 and 256.

    python benchmarks/gpu_check.py                   # fp32 (TF32 matmuls)
    python benchmarks/gpu_check.py --autocast bf16   # fp32, then bf16 autocast
    python benchmarks/gpu_check.py --cpu-smoke       # no GPU: check the script on the CPU

Under 5 minutes on one GPU. Without CUDA (and without --cpu-smoke) it says so and exits 0.
"""

from histoinfer.bench.gpu import main

if __name__ == "__main__":
    raise SystemExit(main())
