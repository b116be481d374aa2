"""A user's model (it lists its pipeline pieces) and data set, defined outside paraloom."""
import torch
from torch import nn

from paraloom.data import DataSets


class Net(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.stem, self.body, self.head = nn.Linear(4, width), nn.Linear(width, width), nn.Linear(width, 3)

    def pipeline_pieces(self):
        return [self.stem, self.body, self.head]

    def forward(self, x):
        for piece in self.pipeline_pieces():
            x = piece(x)
        return x


class Rows(torch.utils.data.Dataset):
    def __init__(self, n):
        self.x, self.y = torch.randn(n, 4), torch.randint(0, 3, (n,))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def make_model(width=16):
    return Net(width)


def make_data(n=10):
    return DataSets(Rows(n), Rows(4), n_classes=3)
