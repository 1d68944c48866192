"""The GPU path in under 5 minutes on one GPU: resnet50 at 224 px, bf16 autocast, channels_last.

Synthetic data (no download), images/s and achieved TFLOP/s against the chip's bf16 peak.
Run it where a GPU is available and copy the printed line into ``bench/results.md``::

    python bench/gpu.py [--batch 256] [--steps 50] [--peak-tflops 989]

The default peak is the H100/H200 SXM dense bf16 figure; pass your chip's.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torchvision
from torch.utils.flop_counter import FlopCounterMode


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--peak-tflops", type=float, default=989.0)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/gpu.py needs a CUDA GPU; none is available here.")
    device = torch.device("cuda")
    torch.backends.cudnn.benchmark = True
    model = torchvision.models.resnet50(num_classes=1000).to(
        device, memory_format=torch.channels_last
    )
    x = torch.randn(args.batch, 3, 224, 224, device=device).contiguous(
        memory_format=torch.channels_last
    )
    y = torch.randint(0, 1000, (args.batch,), device=device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    with FlopCounterMode(display=False) as counter:
        step()
    flops_per_step = counter.get_total_flops()
    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(args.steps):
        step()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t
    tflops = flops_per_step * args.steps / seconds / 1e12
    print(
        json.dumps(
            {
                "device": torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "batch": args.batch,
                "images_per_second": round(args.batch * args.steps / seconds, 1),
                "achieved_tflops": round(tflops, 1),
                "share_of_bf16_peak": round(tflops / args.peak_tflops, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
