"""Rank 1 raises in its training loop; with the argument 'record', under torchrun's @record."""

import sys
import time

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


def train_step(rank: int, step: int) -> None:
    if rank == 1 and step == 2:
        raise ValueError(f"bad batch at step {step}")


def main() -> None:
    dist.init_process_group("gloo")
    for step in range(100):
        train_step(dist.get_rank(), step)
        dist.barrier()
        time.sleep(0.05)


if __name__ == "__main__":
    (record(main) if sys.argv[1:] == ["record"] else main)()
