"""Fails before training: the check reports it could not run, with this traceback."""

import torch.distributed as dist


def load_data(path):
    raise FileNotFoundError(f"{path}: no such file (a script that fails before training)")


if __name__ == "__main__":
    dist.init_process_group("gloo")
    load_data("data/train.csv")
