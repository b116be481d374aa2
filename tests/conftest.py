"""Shared test setup: warm torch.testing once so forked ranks do not each pay for it."""

import sys
from pathlib import Path

import torch
import torch.testing

sys.path.insert(0, str(Path(__file__).parent))  # tests/distributed.py is importable as `distributed`

torch.testing.assert_close(torch.zeros(1), torch.zeros(1))
