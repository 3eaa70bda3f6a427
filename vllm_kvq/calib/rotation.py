"""OSCAR rotations from covariance matrices: R = U · H · P_br.

U are the eigenvectors of the target covariance (queries for keys, attention
outputs or score-weighted values for values), H the orthonormal Sylvester
Hadamard matrix and P_br the eigenvalue-sorted bit-reversal permutation, which
spreads the strongest directions across quantization groups.
"""

from __future__ import annotations

import torch

from vllm_kvq.artifacts.builtin import hadamard


def bit_reversal(d: int) -> list[int]:
    bits = d.bit_length() - 1
    return [int(format(i, f"0{bits}b")[::-1], 2) for i in range(d)] if bits else [0]


def bit_reversal_permutation(eigenvalues: torch.Tensor) -> torch.Tensor:
    """P with ``(x @ P)[br(i)] = x[i-th largest eigen-direction]``."""
    d = eigenvalues.numel()
    order = torch.argsort(eigenvalues, descending=True)
    perm = torch.empty(d, dtype=torch.long)
    for i, j in enumerate(bit_reversal(d)):
        perm[j] = order[i]
    return torch.eye(d, dtype=torch.float64)[:, perm]


def oscar_rotation(cov: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(R, eigenvalues)`` for a symmetric ``[D, D]`` covariance (fp64 math)."""
    c = cov.double()
    c = (c + c.T) / 2
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 128x128 eigh: threads only spin (0.9 s vs 2 ms on a busy 2-core CPU)
    try:
        evals, evecs = torch.linalg.eigh(c)
    finally:
        torch.set_num_threads(threads)
    d = c.shape[0]
    rot = evecs @ hadamard(d).double() @ bit_reversal_permutation(evals)
    return rot.float(), evals.float()
