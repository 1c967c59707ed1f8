"""`SameBatch`, the dataset of the doctor scripts that keep fetching out of the picture (imported by name: a script's
own folder is first on sys.path, under the doctor as under `python script.py`)."""

import torch
from torch.utils.data import Dataset


class SameBatch(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """One ready batch handed out `length` times (with batch_size=None): fetching costs nothing."""

    def __init__(self, batch: tuple[torch.Tensor, torch.Tensor], length: int) -> None:
        self.batch, self.length = batch, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batch
