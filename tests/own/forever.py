"""Trains forever (a loop of barriers): for interrupts and stops."""

import time

import torch.distributed as dist

dist.init_process_group("gloo")
print("started", flush=True)
while True:
    dist.barrier()
    time.sleep(0.1)
