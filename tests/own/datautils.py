"""A module the training script imports: it travels beside it (Script(files=[...]))."""

import torch


def make_data(n: int = 256, seed: int = 0) -> torch.utils.data.TensorDataset:
    """The same synthetic data on every rank (seeded): 8 features, 2 classes."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return torch.utils.data.TensorDataset(x, (x.sum(1) > 0).long())
