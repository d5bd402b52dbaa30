"""The one formula of a contrastive loss's rows: blocks of rows add up to the loss of the batch,
in value and in every gradient, for both kinds."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vlmcompile.ir.contrastive_loss import ContrastiveLoss, LossKind, batch_loss, rows_loss


def _loss(kind):
    return ContrastiveLoss(
        kind, ("a", "b"), "s", "bias" if kind is LossKind.SIGMOID else None, width=6, detail=""
    )


def _clip(a, b, s):
    logits = s * a @ b.t()
    t = torch.arange(len(a))
    return (F.cross_entropy(logits, t) + F.cross_entropy(logits.t(), t)) / 2


def _siglip(a, b, s, bias):
    logits = s * a @ b.t() + bias
    signs = 2 * torch.eye(len(a)) - 1
    return -F.logsigmoid(signs * logits).sum() / len(a)


@pytest.mark.parametrize("kind", list(LossKind))
@pytest.mark.parametrize("blocks", [(7,), (3, 4), (1, 2, 4), (2, 2, 2, 1)])
def test_row_blocks_add_up_to_the_batch_loss_and_its_gradients(kind, blocks):
    g = torch.Generator().manual_seed(sum(blocks) * 10 + len(blocks))
    a, b = (F.normalize(torch.randn(7, 6, generator=g), dim=-1).requires_grad_() for _ in range(2))
    s, bias = torch.tensor(3.0, requires_grad=True), torch.tensor(-2.0, requires_grad=True)
    spec = _loss(kind)
    want = _clip(a, b, s) if kind is LossKind.INFONCE else _siglip(a, b, s, bias)
    want_grads = torch.autograd.grad(want, [a, b, s, bias], allow_unused=True)
    total, first = 0, 0
    for size in blocks:
        for r, c in spec.directions():
            rows = (a, b)[r][first : first + size]
            total = total + rows_loss(kind, rows, (a, b)[c], first, 7, s, bias)
        first += size
    got_grads = torch.autograd.grad(total, [a, b, s, bias], allow_unused=True)
    torch.testing.assert_close(total, want)
    torch.testing.assert_close(batch_loss(spec, a, b, s, bias), want)
    for got, expected in zip(got_grads, want_grads):
        if expected is None:
            assert got is None or not got.any()
        else:
            torch.testing.assert_close(got, expected)


def test_an_infonce_loss_takes_no_bias():
    with pytest.raises(ValueError, match="takes no bias"):
        ContrastiveLoss(LossKind.INFONCE, ("a", "b"), "s", "bias", width=4, detail="")
