"""One intra-op thread for loops of small tensor ops.

A 128x128 state step or a 16-snapshot codec call is too small to split:
thread hand-off costs more than it saves, and far more on a loaded machine.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


@contextmanager
def single_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
