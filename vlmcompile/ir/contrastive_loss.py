"""A contrastive loss that couples the samples of a batch, as data, and the one formula of its rows.

A two-tower model (CLIP, SigLIP) reaches its loss only through the batch's two ``N x D``
embedding matrices (and a learnable temperature, maybe a bias): capture finds those values
(:mod:`vlmcompile.graph.contrastive`) and names the loss's kind. The runtime then computes the loss
of the whole global batch in blocks of rows (a rank's samples, a tile of them), never a loss per
microbatch:

* ``infonce`` (CLIP, Radford et al. 2021): the mean of the two cross-entropies of
  ``scale * a @ b.T`` over its rows and over its columns, the targets on the diagonal;
* ``sigmoid`` (SigLIP, Zhai et al. 2023): ``-sum(logsigmoid(z * (scale * a @ b.T + bias))) / N``
  with ``z`` +1 on the diagonal, -1 elsewhere.

Both are sums over rows of ``a`` against all of ``b`` (and, for InfoNCE, rows of ``b`` against
all of ``a``): :func:`rows_loss` is the term of one block of rows, and the loss of the batch is
the sum of every block's term over :meth:`ContrastiveLoss.directions`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.nn.functional as F


class LossKind(str, enum.Enum):
    INFONCE = "infonce"
    SIGMOID = "sigmoid"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class ContrastiveLoss:
    """The coupled part of a captured graph: what it reads, and which formula it is."""

    kind: LossKind
    embeddings: tuple[str, str]
    """The graph nodes holding the two towers' ``N x D`` embeddings (``a``, ``b``)."""
    scale: str | None
    """The node of the sample-free factor of the similarities (``logit_scale.exp()``), or None."""
    bias: str | None
    """The node of SigLIP's sample-free bias, or None."""
    width: int
    """``D``: the embeddings' width."""
    detail: str
    """How it was recognised (the check against the model's own loss)."""
    tower_layers: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
    """The layers each embedding is made from (a layer both read counts for both)."""

    def __post_init__(self):
        if self.kind is LossKind.INFONCE and self.bias is not None:
            raise ValueError(f"an InfoNCE loss takes no bias (got node {self.bias!r})")

    def directions(self) -> tuple[tuple[int, int], ...]:
        """(rows, columns) pairs of embedding indices whose row blocks sum to the loss."""
        return ((0, 1), (1, 0)) if self.kind is LossKind.INFONCE else ((0, 1),)

    @property
    def scalars(self) -> tuple[str, ...]:
        return tuple(n for n in (self.scale, self.bias) if n is not None)


def rows_loss(
    kind: LossKind,
    rows: torch.Tensor,
    columns: torch.Tensor,
    first_row: int,
    num_samples: int,
    scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The loss term of samples ``[first_row, first_row + len(rows))`` as rows against every
    sample's ``columns`` (the whole batch's other embedding, ``num_samples`` rows).

    The targets of row ``i`` sit in column ``first_row + i``; the normalisation is the whole
    batch's (``2 N`` for InfoNCE's two directions, ``N`` for the sigmoid), so the terms of all
    blocks add up to the loss of the batch.
    """
    logits = rows @ columns.t()
    if scale is not None:
        logits = logits * scale
    targets = torch.arange(first_row, first_row + rows.shape[0], device=rows.device)
    if kind is LossKind.INFONCE:
        return F.cross_entropy(logits, targets, reduction="sum") / (2 * num_samples)
    if bias is not None:
        logits = logits + bias
    signs = torch.full_like(logits, -1.0)
    signs[torch.arange(rows.shape[0], device=rows.device), targets] = 1.0
    return -F.logsigmoid(signs * logits).sum() / num_samples


def batch_loss(
    loss: ContrastiveLoss,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The loss of a whole batch from its two embeddings, in one block."""
    embeddings = (a, b)
    return sum(
        rows_loss(loss.kind, embeddings[r], embeddings[c], 0, a.shape[0], scale, bias)
        for r, c in loss.directions()
    )
