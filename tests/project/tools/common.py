"""A module beside tools/unsharded.py: imported from the script's own folder."""

import torch
from torch.utils.data import TensorDataset


def read_rows(path: str) -> TensorDataset:
    with open(path) as f:
        rows = torch.tensor([[float(v) for v in line.split()] for line in f if line.strip()])
    return TensorDataset(rows[:, :-1], rows[:, -1].long())
