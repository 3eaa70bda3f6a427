"""OSCAR rotations from covariance matrices: R = U · H · P_br.

U are the eigenvectors of the target covariance (queries for keys, attention
outputs or score-weighted values for values), H the orthonormal Sylvester
Hadamard matrix and P_br the eigenvalue-sorted bit-reversal permutation, which
spreads the strongest directions across quantization groups.

A tiered rotation keeps the eigen-directions in descending eigenvalue order
and cuts them into the tiers of a :class:`~vllm_kvq.kernels.oscar.format.TierPlan`
(INT4, INT2, not stored); each stored tier is mixed among itself by an
orthogonal spreader S_i, so ``R = [U_1 S_1 | U_2 S_2 | ...]`` with U_i the
tier's eigenvectors. A 0-bit tier keeps its eigenvectors as they are.
"""

from __future__ import annotations

import torch

from vllm_kvq.artifacts.builtin import hadamard
from vllm_kvq.calib import single_thread
from vllm_kvq.kernels.oscar.format import TierPlan


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


def _eigh(cov: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Ascending eigenvalues and eigenvectors of a symmetric matrix (fp64)."""
    c = cov.double()
    with single_thread():  # a 128x128 eigh: threads only spin (0.9 s vs 2 ms on a busy 2-core CPU)
        return torch.linalg.eigh((c + c.T) / 2)


def oscar_rotation(cov: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(R, eigenvalues)`` for a symmetric ``[D, D]`` covariance (fp64 math)."""
    evals, evecs = _eigh(cov)
    d = evecs.shape[0]
    rot = evecs @ hadamard(d).double() @ bit_reversal_permutation(evals)
    return rot.float(), evals.float()


def spreader(n: int, seed: int) -> torch.Tensor:
    """An ``n x n`` orthogonal mixer (fp64): the normalized Sylvester Hadamard
    when n is a power of two, else a seeded random orthogonal matrix (QR of a
    normal matrix, signs fixed so that R has a positive diagonal)."""
    if n & (n - 1) == 0:
        return hadamard(n).double()
    gen = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))


def tier_seed(layer: int, head: int, tier: int) -> int:
    return 1000 * layer + 10 * head + tier


def eigen_order(cov: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(U, eigenvalues)``: eigenvectors in descending eigenvalue order (fp64)
    and the eigenvalues as :func:`oscar_rotation` returns them (ascending)."""
    evals, evecs = _eigh(cov)
    return evecs[:, torch.argsort(evals, descending=True)], evals.float()


def tiered_rotation(u: torch.Tensor, plan: TierPlan, layer: int, head: int) -> torch.Tensor:
    """R: columns ``[U[:, s_i:s_i+w_i] @ S_i ...]`` over the plan's tiers (U from
    :func:`eigen_order`), S_i the spreader of tier i (seed ``1000*layer +
    10*head + i``; identity for a 0-bit tier)."""
    cols, start = [], 0
    for i, (width, bits) in enumerate(plan.pairs):
        block = u[:, start:start + width]
        cols.append(block @ spreader(width, tier_seed(layer, head, i)) if bits else block)
        start += width
    return torch.cat(cols, dim=1).float()


def rotate_heads(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Rows ``[H*g, T, D]`` (heads grouped by KV head) times R ``[D, D]`` or per KV head ``[H, D, D]``."""
    r = r.to(x.dtype)
    return x @ r if r.dim() == 2 else (x.view(r.shape[0], -1, *x.shape[1:]) @ r.unsqueeze(1)).view_as(x)
