"""Where a loss couples the samples of a batch, and whether it is a contrastive loss we can shard.

A loss that does not split over microbatches (:mod:`.loss_split`) trains right only on the whole
batch. When the coupling is a contrastive loss over two towers' embeddings, a step can still be
microbatched: every microbatch's tower forwards, the loss of the whole batch on the gathered
embeddings, every microbatch's backward seeded with its rows of the embeddings' gradients.

This module finds that cut on the sample batch. It runs the graph twice: on the batch, and on the
batch with sample 0 replaced by sample 1. A node whose rows of samples 1..N-1 stay the same, and
whose rows of sample 0 become sample 1's, is *per sample*; a node that does not depend on the
batch is *sample-free* (a parameter, ``logit_scale.exp()``); any other node depending on the batch
is *coupled*. The loss phase starts at the coupled nodes: it reads per-sample embeddings (the
cut's embeddings) and sample-free scalars. The cut is accepted only when those are two ``N x D``
embeddings and at most two scalars, and the model's own loss equals one of the formulas of
:mod:`vlmcompile.ir.contrastive_loss` - in value and in every gradient, on the sample batch's
embeddings and on random ones. Anything else (BatchNorm in a tower, a loss reading labels, an
unknown formula) is refused, naming the node where the samples first meet.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from vlmcompile.graph.subgraph import ancestors, extract
from vlmcompile.ir.contrastive_loss import ContrastiveLoss, LossKind, batch_loss
from vlmcompile.ir.meta_keys import LAYER_META
from vlmcompile.ir.microbatch import num_samples, rows_per_sample


class Batching(str, enum.Enum):
    PER_SAMPLE = "per-sample"
    SAMPLE_FREE = "sample-free"
    COUPLED = "coupled"


@dataclass(frozen=True, slots=True)
class CouplingCut:
    """The outcome: the recognised loss, or why the batch cannot be cut (then ``loss`` is None)."""

    loss: ContrastiveLoss | None
    meeting_points: tuple[str, ...]
    """The coupled nodes that read only per-sample and sample-free values: where samples meet,
    as ``node (layer)``."""
    refusal: str | None = None

    def __post_init__(self):
        if (self.loss is None) == (self.refusal is None):
            raise ValueError("a coupling cut holds a loss or a refusal, exactly one")


def find_coupling(gm: fx.GraphModule, batch: Mapping[str, Any]) -> CouplingCut:
    """Cut ``gm`` (returning the loss) between its towers and its coupled loss, on the real
    tensors of ``batch`` (two samples at least)."""
    samples = num_samples(batch)
    if samples < 2:
        return CouplingCut(None, (), "a sample batch of one sample shows no coupling; give two or more")
    twin = _differing_sample(batch)
    if twin is None:
        return CouplingCut(
            None,
            (),
            "no sample of the sample batch differs from sample 0 in every input that varies; give "
            "samples that differ (another image and another text)",
        )
    values = record_values(gm, batch)
    perturbed = record_values(gm, _sample_0_as(batch, twin))
    batching, batch_dims = _classify(gm, values, perturbed, samples, twin)
    meeting_nodes = [
        n
        for n in gm.graph.nodes
        if batching.get(n) is Batching.COUPLED
        and all(batching.get(p) is not Batching.COUPLED for p in n.all_input_nodes)
    ]
    meeting = tuple(_describe(n, gm) for n in meeting_nodes)
    read = [
        n
        for n in gm.graph.nodes
        if batching.get(n) is Batching.PER_SAMPLE
        and any(batching.get(u) is Batching.COUPLED for u in n.users)
    ]
    embeddings = list(dict.fromkeys(_with_samples_first(n, batching, batch_dims, values) for n in read))
    scalars = [
        n
        for n in gm.graph.nodes
        if batching.get(n) is Batching.SAMPLE_FREE
        and _is_trainable_scalar(n, values[n], gm)
        and any(batching.get(u) is Batching.COUPLED for u in n.users)
    ]
    refusal = _tower_refusal(gm, meeting_nodes, embeddings) or _shape_refusal(
        embeddings, scalars, values, samples, meeting
    )
    if refusal is not None:
        return CouplingCut(None, meeting, refusal)
    # Sizes read off any tensor (``pixel_values.shape[0]`` for ``arange(N)`` targets) are the
    # sample batch's: constants of the loss, which is recognised on embeddings of that batch's shapes.
    layout = {
        n: values[n] for n in gm.graph.nodes if batching.get(n) is Batching.SAMPLE_FREE and _reads_layout(n)
    }
    try:
        module = loss_module(gm, [*embeddings, *scalars], layout)
    except ValueError as err:
        return CouplingCut(None, meeting, str(err))
    loss = _recognise(module, embeddings, scalars, values)
    if isinstance(loss, str):
        return CouplingCut(None, meeting, loss)
    return CouplingCut(dataclasses.replace(loss, tower_layers=_tower_layers(gm, embeddings)), meeting)


def _tower_layers(
    gm: fx.GraphModule, embeddings: Sequence[fx.Node]
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The layers each embedding is made from, in graph order (what the planner times per tower)."""
    out = []
    for embedding in embeddings:
        seen = ancestors([embedding])
        layers = [n.meta.get(LAYER_META) for n in gm.graph.nodes if n in seen]
        out.append(tuple(dict.fromkeys(x for x in layers if x)))
    return out[0], out[1]


def _describe(n: fx.Node, gm: fx.GraphModule) -> str:
    """``node (layer, ModuleClass)``: where a user finds it in their model."""
    module = None
    if n.op == "call_module":
        module = type(gm.get_submodule(str(n.target))).__name__
    elif n.meta.get("nn_module_stack"):
        module = list(n.meta["nn_module_stack"].values())[-1][1]
        module = getattr(module, "__name__", str(module).rsplit(".", 1)[-1])
    where = ", ".join(x for x in (n.meta.get(LAYER_META), module) if x)
    return f"{n.name} ({where or 'no layer'})"


def _batch_inputs_behind(gm: fx.GraphModule) -> dict[fx.Node, frozenset[str]]:
    out: dict[fx.Node, frozenset[str]] = {}
    for n in gm.graph.nodes:
        own = frozenset([str(n.target)]) if n.op == "placeholder" else frozenset()
        out[n] = own.union(*(out[p] for p in n.all_input_nodes))
    return out


def _tower_refusal(
    gm: fx.GraphModule, meeting: Sequence[fx.Node], embeddings: Sequence[fx.Node]
) -> str | None:
    """Why the samples do not meet only where two towers meet: in a batch input the loss reads
    beside the embeddings, inside one tower (BatchNorm), or in a loss of one tower alone."""
    given = [n for n in embeddings if n.op == "placeholder"]
    if given:
        return (
            f"the loss reads batch input {str(given[0].target)!r} beside the embeddings; only a loss of the "
            "two towers' embeddings (and trainable scalars) can be computed on the whole batch apart"
        )
    behind = _batch_inputs_behind(gm)
    towers_read = behind[next(n for n in gm.graph.nodes if n.op == "output")]
    inside = [n for n in meeting if behind[n] < towers_read]
    if inside:
        return (
            f"the samples of a batch meet inside a tower, at {', '.join(_describe(n, gm) for n in inside[:3])}, "
            f"which reads only {sorted(behind[inside[0]])}: a module that mixes the samples outside the loss "
            "(BatchNorm) cannot be microbatched; use a per-sample norm (LayerNorm) or put it in eval mode"
        )
    if len(embeddings) == 2 and (
        behind[embeddings[0]] <= behind[embeddings[1]] or behind[embeddings[1]] <= behind[embeddings[0]]
    ):
        return (
            f"the loss's two embeddings ({embeddings[0].name}, {embeddings[1].name}) come from the same inputs "
            f"({sorted(behind[embeddings[0]] | behind[embeddings[1]])}): a loss of one tower, not a contrastive "
            "loss between two"
        )
    return None


def record_values(gm: fx.GraphModule, batch: Mapping[str, Any]) -> dict[fx.Node, Any]:
    """Every node's value when ``gm`` runs on ``batch`` (no gradients)."""
    recorder = _Recorder(gm)
    args = [batch[str(n.target)] for n in gm.graph.nodes if n.op == "placeholder"]
    # Every run draws the same random numbers (dropout), so only the batch differs between runs.
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(0)
        recorder.run(*args)
    return recorder.values


class _Recorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.values: dict[fx.Node, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        self.values[n] = out
        return out


def _differing_sample(batch: Mapping[str, Any]) -> int | None:
    """A sample that differs from sample 0 in every input in which any sample does (so that putting
    it in sample 0's place changes everything that reads sample 0's data)."""
    rows = rows_per_sample(batch)
    samples = num_samples(batch)

    def differs(key: str, j: int) -> bool:
        v, r = batch[key], rows[key]
        return not torch.equal(v[:r], v[j * r : (j + 1) * r])

    varying = [k for k in batch if rows[k] and any(differs(k, j) for j in range(1, samples))]
    if not varying:
        return None
    return next((j for j in range(1, samples) if all(differs(k, j) for k in varying)), None)


def _sample_0_as(batch: Mapping[str, Any], twin: int) -> dict[str, Any]:
    rows = rows_per_sample(batch)
    return {
        k: torch.cat([v[twin * rows[k] : (twin + 1) * rows[k]], v[rows[k] :]]) if rows[k] else v
        for k, v in batch.items()
    }


def _classify(
    gm: fx.GraphModule,
    values: Mapping[fx.Node, Any],
    perturbed: Mapping[fx.Node, Any],
    samples: int,
    twin: int,
) -> tuple[dict[fx.Node, Batching], dict[fx.Node, int]]:
    """Each node's batching, and the dimension that holds the samples of each per-sample node."""
    out: dict[fx.Node, Batching] = {}
    dims: dict[fx.Node, int] = {}
    for n in gm.graph.nodes:
        if n.op == "output":
            continue
        value, other = values.get(n), perturbed.get(n)
        if n.op == "placeholder":
            out[n], dims[n] = Batching.PER_SAMPLE, 0
            continue
        dim = None
        if all(out[p] is Batching.SAMPLE_FREE for p in n.all_input_nodes) or _unchanged(value, other):
            # Unchanged although sample 0 changed: made from the batch's shape, not its data
            # (``ones_like(logits)``, a size read off a tensor).
            out[n] = Batching.SAMPLE_FREE
        elif (dim := _samples_dim(value, other, samples, twin)) is not None:
            out[n], dims[n] = Batching.PER_SAMPLE, dim
        else:
            out[n] = Batching.COUPLED
    return out, dims


def _with_samples_first(
    n: fx.Node,
    batching: Mapping[fx.Node, Batching],
    dims: Mapping[fx.Node, int],
    values: Mapping[fx.Node, Any],
) -> fx.Node:
    """``n``, or the value it was laid out from when ``n`` holds the samples elsewhere than first
    (``embeds.t()`` read by the similarity): the cut then falls before the transpose."""
    while dims.get(n, 0) != 0:
        sources = [p for p in n.all_input_nodes if batching.get(p) is Batching.PER_SAMPLE]
        if len(sources) != 1 or not isinstance(values.get(sources[0]), torch.Tensor):
            break
        if values[sources[0]].numel() != values[n].numel():
            break
        n = sources[0]
    return n


def _samples_dim(value: Any, other: Any, samples: int, twin: int) -> int | None:
    """The dimension along which only sample 0's rows changed, into sample ``twin``'s (attention may
    hold the batch second), or None."""
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, torch.Tensor) for v in value):
        if len(value) != len(other):
            return None
        dims = [_samples_dim(v, o, samples, twin) for v, o in zip(value, other)]
        return None if any(d is None for d in dims) else 0
    if (
        not isinstance(value, torch.Tensor)
        or not isinstance(other, torch.Tensor)
        or value.shape != other.shape
    ):
        return None
    for dim in range(value.dim()):
        if value.shape[dim] % samples:
            continue
        k = value.shape[dim] // samples
        v, o = value.movedim(dim, 0), other.movedim(dim, 0)
        if _same(v[k:], o[k:]) and _same(o[:k], v[twin * k : (twin + 1) * k]):
            return dim
    return None


def _same(x: torch.Tensor, y: torch.Tensor) -> bool:
    if not x.is_floating_point():
        return torch.equal(x, y)
    scale = float(y.abs().max()) if y.numel() else 0.0
    return bool(torch.allclose(x, y, rtol=1e-4, atol=1e-5 * max(scale, 1.0), equal_nan=True))


def _unchanged(value: Any, other: Any) -> bool:
    if isinstance(value, torch.Tensor) and isinstance(other, torch.Tensor):
        return value.shape == other.shape and value.dtype == other.dtype and _same(value, other)
    if isinstance(value, (tuple, list)) and isinstance(other, (tuple, list)):
        return len(value) == len(other) and all(_unchanged(v, o) for v, o in zip(value, other))
    try:
        return bool(value == other)
    except Exception:  # a value without a truth value: not a plain Python value
        return False


def _is_trainable_scalar(n: fx.Node, value: Any, gm: fx.GraphModule) -> bool:
    if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.numel() != 1:
        return False
    # Trainable only if a parameter lies behind it.
    return any(
        m.op == "get_attr" and isinstance(_attr(gm, str(m.target)), torch.nn.Parameter)
        for m in ancestors([n])
    )


def _attr(gm: fx.GraphModule, path: str) -> Any:
    obj: Any = gm
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _shape_refusal(
    embeddings: Sequence[fx.Node],
    scalars: Sequence[fx.Node],
    values: Mapping[fx.Node, Any],
    samples: int,
    meeting: Sequence[str],
) -> str | None:
    where = f"the samples meet at {', '.join(meeting[:4]) or 'no node'}"
    shapes = [
        list(values[n].shape) if isinstance(values[n], torch.Tensor) else type(values[n]).__name__
        for n in embeddings
    ]
    if len(embeddings) != 2:
        return (
            f"{where}, which read {len(embeddings)} per-sample values ({', '.join(n.name for n in embeddings[:6])}, "
            f"shapes {shapes[:6]}), not two towers' embeddings: only a contrastive loss over two N x D "
            "embeddings can be microbatched; a module that mixes samples inside a tower (BatchNorm) cannot"
        )
    if any(s != [samples, shapes[0][-1]] for s in shapes if isinstance(s, list)) or not all(
        isinstance(s, list) for s in shapes
    ):
        return f"{where}; the values read there have shapes {shapes}, not two {samples} x D embeddings"
    if len(scalars) > 2:
        return f"{where}; the loss reads {len(scalars)} trainable scalars ({[n.name for n in scalars]}), not a scale and a bias"
    return None


_LAYOUT_ATTRS = frozenset({"shape", "device", "dtype", "ndim"})


def _reads_layout(n: fx.Node) -> bool:
    """Whether ``n`` reads a tensor's layout, not its values: ``x.shape``, ``x.size(0)``,
    ``x.device``, export's ``sym_size``."""
    if n.op == "call_method":
        return n.target in ("size", "dim")
    if n.op != "call_function":
        return False
    if n.target is getattr:
        return len(n.args) == 2 and n.args[1] in _LAYOUT_ATTRS
    return n.target in (torch.ops.aten.sym_size.int, torch.ops.aten.sym_size.default)


def loss_module(
    gm: fx.GraphModule, cut: Sequence[fx.Node], constants: Mapping[fx.Node, Any] | None = None
) -> fx.GraphModule:
    """The part of ``gm`` from the ``cut`` values to the loss, as a module taking them in order;
    the nodes of ``constants`` are taken as their values (sizes of the sample batch).

    Raises:
        ValueError: the loss also reads batch inputs that are not behind the cut.
    """
    output = next(n for n in gm.graph.nodes if n.op == "output")
    loss = output.args[0]
    while isinstance(loss, (tuple, list)):
        loss = loss[0]
    constants = dict(constants or {})
    needed = ancestors([loss], stop=[*cut, *constants])
    read = [n for n in gm.graph.nodes if n in needed and n.op == "placeholder"]
    if read:
        raise ValueError(
            f"the loss reads batch input {read[0].target!r} besides the embeddings; only a loss of the two "
            "embeddings (and trainable scalars) can be computed on the whole batch apart"
        )
    nodes = [n for n in gm.graph.nodes if n in needed]
    module, inputs = extract(gm, nodes, [loss], class_name="ContrastiveLoss")
    order = {n: i for i, n in enumerate(cut)}
    # extract() orders its arguments by first use; the caller's order is the cut's.
    bound = [order[p] if p in order else _Constant(constants[p]) for p in inputs]
    module.graph = _reordered_placeholders(module.graph, bound, len(cut))
    module.recompile()
    return module


@dataclass(frozen=True, slots=True)
class _Constant:
    value: Any


def _reordered_placeholders(graph: fx.Graph, positions: Sequence[int | _Constant], count: int) -> fx.Graph:
    """``graph`` taking ``count`` arguments, its i-th placeholder bound to argument ``positions[i]``,
    or to a constant's value (arguments it does not read are taken and ignored)."""
    new = fx.Graph()
    olds = [n for n in graph.nodes if n.op == "placeholder"]
    args = [new.placeholder(f"arg_{i}") for i in range(count)]
    env = {old: pos.value if isinstance(pos, _Constant) else args[pos] for old, pos in zip(olds, positions)}
    for n in graph.nodes:
        if n.op != "placeholder":
            env[n] = new.node_copy(n, lambda p: env[p])
    return new


def _recognise(
    module: fx.GraphModule,
    embeddings: Sequence[fx.Node],
    scalars: Sequence[fx.Node],
    values: Mapping[fx.Node, Any],
) -> ContrastiveLoss | str:
    """The first formula that equals ``module`` in value and gradients, or why none does."""
    embedding_names = [n.name for n in embeddings]
    scalar_names = [n.name for n in scalars]
    actual = [values[n].detach().float() for n in [*embeddings, *scalars]]
    trials = [actual, _random_like(actual, seed=1), _random_like(actual, seed=2)]
    options = [None, *range(len(scalars))]
    tried = []
    for kind, scale, bias in itertools.product(LossKind, options, options):
        if (bias is not None and (kind is LossKind.INFONCE or bias == scale)) or (
            scale is None and bias is not None
        ):
            continue
        candidate = ContrastiveLoss(
            kind,
            (embedding_names[0], embedding_names[1]),
            None if scale is None else scalar_names[scale],
            None if bias is None else scalar_names[bias],
            width=int(actual[0].shape[-1]),
            detail="",
        )
        worst = max(_mismatch(module, candidate, t, scale, bias) for t in trials)
        tried.append(
            f"{kind}{'' if scale is None else ' scaled'}{'' if bias is None else ' with bias'}: {worst:.2g}"
        )
        if worst <= 1e-4:
            return dataclasses.replace(
                candidate,
                detail=(
                    f"{kind} loss over {embedding_names[0]} and {embedding_names[1]}: equal to the model's own "
                    f"in value and gradients on the sample batch and two random batches (largest relative "
                    f"difference {worst:.1e})"
                ),
            )
    return (
        "the loss over the two embeddings is none of the contrastive losses vlmcompile can shard "
        f"(largest relative difference of each to the model's own: {'; '.join(tried)})"
    )


def _random_like(tensors: Sequence[torch.Tensor], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = [torch.nn.functional.normalize(torch.randn(t.shape, generator=g), dim=-1) for t in tensors[:2]]
    out += [t * (1 + 0.5 * torch.rand((), generator=g)) for t in tensors[2:]]
    return out


def _mismatch(
    module: fx.GraphModule,
    loss: ContrastiveLoss,
    inputs: Sequence[torch.Tensor],
    scale: int | None,
    bias: int | None,
) -> float:
    """The largest relative difference between ``module`` and ``loss`` in value and gradients."""
    theirs = [t.clone().requires_grad_() for t in inputs]
    ours = [t.clone().requires_grad_() for t in inputs]
    with torch.enable_grad():
        out = module(*theirs)
        value = out[0] if isinstance(out, (tuple, list)) else out
        want = torch.autograd.grad(value, theirs, allow_unused=True)
        s = None if scale is None else ours[2 + scale]
        b = None if bias is None else ours[2 + bias]
        mine = batch_loss(loss, ours[0], ours[1], s, b)
        got = torch.autograd.grad(mine, ours, allow_unused=True)
    worst = _relative(mine.detach(), value.detach())
    for w, g, t in zip(want, got, ours):
        w = torch.zeros_like(t) if w is None else w
        g = torch.zeros_like(t) if g is None else g
        worst = max(worst, _relative(g, w))
    return worst


def _relative(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x.double() - y.double()).abs().max() / (y.double().abs().max() + 1e-12))
