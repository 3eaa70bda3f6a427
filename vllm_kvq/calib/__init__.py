"""Offline statistics that become artifacts (see vllm_kvq.artifacts)."""

from contextlib import contextmanager

import torch


@contextmanager
def single_thread():
    """One intra-op thread for loops of small tensor ops (a 128x128 eigh or state step, a 16-snapshot
    codec call): thread hand-off costs more than it saves, and far more on a loaded machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
