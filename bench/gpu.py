"""The bare synthetic training loop: the GPU's ceiling for a model, batch and precision.

resnet50 at 224 px, bf16 autocast, channels_last and fused SGD by default, on one random
batch that stays on the device (no data pipeline, no DDP, no metrics): what the chip
does with nothing around the step. ``bench/gpu_check.py`` runs it beside ddpnb's worker
with the worker's settings and prints worker / bare loop. It prints one JSON line::

    python bench/gpu.py [--batch 256] [--steps 50] [--num-classes 1000] [--peak-tflops 989]

The default peak is the H100/H200 SXM dense bf16 figure; pass your chip's. FLOPs come
from torch's own counter (2 per multiply-add, the convention of the chip's peak).
``--device cpu`` runs the same loop on the CPU (fp32), so the script can be checked
where no GPU is lent.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torchvision
from torch.utils.flop_counter import FlopCounterMode

H200_BF16_DENSE_TFLOPS = 989.0


def bare_loop(
    *,
    model: str = "resnet50",
    batch: int = 256,
    image_size: int = 224,
    num_classes: int = 1000,
    steps: int = 50,
    warmup: int = 10,
    amp: bool = True,
    channels_last: bool = True,
    cudnn_benchmark: bool = True,
    lr: float = 0.05,
    momentum: float = 0.9,
    weight_decay: float = 5e-4,
    peak_tflops: float = H200_BF16_DENSE_TFLOPS,
    device: str = "cuda",
) -> dict:
    """Time ``steps`` training steps on one resident random batch; return the figures.

    Returns a dict with ``images_per_second``, ``flops_per_image`` (training: forward and
    backward), ``achieved_tflops`` and ``share_of_peak``. bf16 autocast applies on CUDA only.

    Example
    -------
    >>> r = bare_loop(model="resnet18", batch=8, image_size=32, steps=2, warmup=1, device="cpu")
    >>> r["images_per_second"] > 0
    True
    """
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    if cuda:
        torch.backends.cudnn.benchmark = cudnn_benchmark
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    net = torchvision.models.get_model(model, num_classes=num_classes)
    net = net.to(dev, memory_format=fmt)
    x = torch.randn(batch, 3, image_size, image_size, device=dev).contiguous(memory_format=fmt)
    y = torch.randint(0, num_classes, (batch,), device=dev)
    opt = torch.optim.SGD(
        net.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay, fused=True
    )
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> None:
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp and cuda):
            loss = loss_fn(net(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    with FlopCounterMode(display=False) as counter:
        step()
    flops_per_step = counter.get_total_flops()
    for _ in range(warmup):
        step()
    sync()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    sync()  # the queue drains here: the GPU's time, not the time to enqueue
    seconds = time.perf_counter() - t
    tflops = flops_per_step * steps / seconds / 1e12
    return {
        "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
        "torch": torch.__version__,
        "model": model,
        "batch": batch,
        "image_size": image_size,
        "amp": amp and cuda,
        "channels_last": channels_last,
        "cudnn_benchmark": cudnn_benchmark and cuda,
        "steps": steps,
        "images_per_second": round(batch * steps / seconds, 1),
        "flops_per_image": flops_per_step / batch,
        "achieved_tflops": round(tflops, 2),
        "share_of_peak": round(tflops / peak_tflops, 4),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--no-amp", dest="amp", action="store_false", help="fp32 instead of bf16")
    p.add_argument("--no-channels-last", dest="channels_last", action="store_false")
    p.add_argument("--no-cudnn-benchmark", dest="cudnn_benchmark", action="store_false")
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS)
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("bench/gpu.py needs a CUDA GPU; none is available here (--device cpu).")
    result = bare_loop(
        model=args.model,
        batch=args.batch,
        image_size=args.image_size,
        num_classes=args.num_classes,
        steps=args.steps,
        warmup=args.warmup,
        amp=args.amp,
        channels_last=args.channels_last,
        cudnn_benchmark=args.cudnn_benchmark,
        weight_decay=args.weight_decay,
        peak_tflops=args.peak_tflops,
        device=args.device,
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
