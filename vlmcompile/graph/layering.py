"""Group the nodes of a captured graph into layers and give each layer a region.

A *block* is a repeated transformer layer: an element of an ``nn.ModuleList`` that holds a
norm and a linear layer and no block list of its own (so ``encoders.0`` of a two-encoder
VLM is not a block, ``encoders.0.blocks.3`` is, and an MoE expert without a norm is not).
A *container* is a module that holds a block (the model, an encoder, a ModuleList of
blocks). A node's layer is the block on its module path if there is one, else the first
module on that path that is neither a container nor a ModuleList/ModuleDict (``llm.embed``,
``projectors.0``, ``lm_head``).

Nodes with no layer of their own - code written directly in a container's ``forward``
(concatenating image and text tokens, building masks) and parameter reads - join the layer
of their first user; nodes no layer consumes (the loss after ``lm_head``) join the layer of
their last producer. Layers are ordered topologically along the values they exchange, ties
broken by where each first appears in the graph.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping

import networkx as nx
import torch.fx as fx
from torch import nn

from vlmcompile.ir.errors import RegionError
from vlmcompile.ir.meta_keys import LAYER_META, REGION_META
from vlmcompile.ir.regions import (
    ENCODER_REGIONS,
    ENCODER_SIDE,
    LANGUAGE_REGIONS,
    REGION_ATTR,
    Region,
    override_region,
    region_from_keywords,
)


def _is_norm(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower()


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or type(module).__name__ in {"Conv1D", "Linear"}


def find_blocks(model: nn.Module) -> set[str]:
    """Module paths of the model's transformer blocks (see the module docstring)."""
    candidates: set[str] = set()
    for path, module in model.named_modules():
        if not isinstance(module, nn.ModuleList):
            continue
        for index, child in enumerate(module):
            subs = list(child.modules())
            if any(_is_norm(m) for m in subs) and any(_is_linear(m) for m in subs):
                candidates.add(f"{path}.{index}" if path else str(index))
    return {c for c in candidates if not any(o.startswith(c + ".") for o in candidates)}


def module_path(node: fx.Node, strip_prefix: str = "") -> str | None:
    """Innermost module path on the node's ``nn_module_stack`` (None when it has none)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path = list(stack.values())[-1][0]
    if path.startswith("_empty_nn_module_stack"):
        return None  # export's placeholder for code of the captured root itself: glue
    if strip_prefix:
        if path == strip_prefix.rstrip("."):
            return ""
        path = path.removeprefix(strip_prefix)
    return path


class LayerAssigner:
    """Maps module paths of one model to layer names and regions."""

    def __init__(
        self, model: nn.Module, overrides: Mapping[str, Region], keywords: Mapping[str, Region] | None = None
    ):
        self.modules = dict(model.named_modules())
        self.keywords = dict(keywords or {})
        """The model's family's own path components (``vlmcompile.families``), matched first."""
        self.blocks = find_blocks(model)
        self.containers = {p for b in self.blocks for p in _prefixes(b)} | {""}
        self.overrides = dict(overrides)
        self.generative = any(path.rsplit(".", 1)[-1] == "lm_head" for path in self.modules)

    def layer_of(self, path: str | None) -> str | None:
        """The layer a module path belongs to, or None for container-level code."""
        if path is None or path in self.containers:
            return None
        parts = path.split(".")
        prefixes = [".".join(parts[: i + 1]) for i in range(len(parts))]
        for prefix in prefixes:
            if prefix in self.blocks:
                return prefix
        for prefix in prefixes:
            module = self.modules.get(prefix)
            if prefix in self.containers or isinstance(module, nn.ModuleList | nn.ModuleDict):
                continue
            return prefix
        return None

    def region_of(self, layer: str) -> tuple[Region, str]:
        """(region, how it was found) for a layer name."""
        found = override_region(layer, self.overrides)
        if found is not None:
            return found, "override"
        parts = layer.split(".")
        for i in range(len(parts), 0, -1):
            attr = getattr(type(self.modules.get(".".join(parts[:i]))), REGION_ATTR, None)
            if attr is not None:
                return Region(attr), "module attribute"
        found = region_from_keywords(layer, generative=self.generative, family=self.keywords)
        if found is not None:
            return found, "path keyword"
        return Region.OTHER, "undetected"


def _prefixes(path: str) -> list[str]:
    parts = path.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def regions_by_flow(
    order: list[str], flow: nx.DiGraph, assigner: LayerAssigner
) -> dict[str, tuple[Region, str]]:
    """(region, how it was found) per layer: by override, attribute or keyword first. Then by
    the data flow, whatever a layer's name: one none of those place that reads from an encoder
    tower (vision, or a contrastive pair's text tower) and from nothing of the LLM or head is a
    projector (Blip2's Q-Former blocks and ``language_projection``, CLIP's ``text_projection``);
    so is one that feeds projectors alone (the Q-Former's norm of its learned queries)."""
    found = {layer: assigner.region_of(layer) for layer in order}
    towers = {Region.VISION, Region.TEXT}
    for layer in order:
        if found[layer][0] is not Region.OTHER:
            continue
        upstream = {found[a][0] for a in nx.ancestors(flow, layer)}
        if upstream & towers and not upstream & {Region.LLM, Region.HEAD}:
            found[layer] = (Region.PROJECTOR, "data flow")
    for layer in reversed(order):
        readers = {found[d][0] for d in flow.successors(layer)}
        if found[layer][0] is Region.OTHER and readers == {Region.PROJECTOR}:
            found[layer] = (Region.PROJECTOR, "data flow")
    return found


def assign_layers(
    gm: fx.GraphModule, assigner: LayerAssigner, *, strip_prefix: str = ""
) -> dict[str, tuple[Region, str]]:
    """Tag every node with its layer and region; return each layer's region and how it was
    found, in pipeline order. Four phases: the nodes modules own, the data flow between layers
    (through the glue nodes no module owns), the layer order, and the glue given to layers."""
    nodes = list(gm.graph.nodes)
    own, glue = _owned_nodes(nodes, assigner, strip_prefix)
    flow, first_seen = _layer_flow(nodes, own, glue)
    order, regions = _layer_order(flow, first_seen, assigner)
    rank = {layer: i for i, layer in enumerate(order)}
    _place_glue(nodes, own, glue, rank, order)
    for n in nodes:
        layer = own.get(n)
        n.meta[LAYER_META] = layer
        n.meta[REGION_META] = regions[layer][0] if layer else None
        for p in n.all_input_nodes:
            assert p not in own or layer is None or rank[own[p]] <= rank[layer], (p, n)
    return regions


def _owned_nodes(
    nodes: list[fx.Node], assigner: LayerAssigner, strip_prefix: str
) -> tuple[dict[fx.Node, str], list[fx.Node]]:
    """Each node a module owns -> its layer; and the glue: the computing nodes no module owns."""
    own: dict[fx.Node, str] = {}
    glue: list[fx.Node] = []
    for n in nodes:
        if n.op in ("placeholder", "output"):
            continue
        layer = None
        if n.op == "call_module":
            layer = assigner.layer_of(str(n.target)) or assigner.layer_of(module_path(n, strip_prefix))
        elif n.op != "get_attr":
            layer = assigner.layer_of(module_path(n, strip_prefix))
        if layer is None:
            glue.append(n)
        else:
            own[n] = layer
    if not own:
        raise RegionError(
            "no node of the captured graph belongs to a module of the model, so no layers can be "
            "formed; wrap the computation in nn.Module children"
        )
    return own, glue


def _glue_producers(glue: list[fx.Node], own: dict[fx.Node, str]) -> dict[fx.Node, set[str]]:
    """Per glue node, the owned layers whose values reach it through glue alone."""
    producers: dict[fx.Node, set[str]] = {}
    for n in glue:
        producers[n] = set().union(
            *([{own[p]} if p in own else producers.get(p, set()) for p in n.all_input_nodes] or [set()])
        )
    return producers


def _layer_flow(
    nodes: list[fx.Node], own: dict[fx.Node, str], glue: list[fx.Node]
) -> tuple[nx.DiGraph, dict[str, int]]:
    """Which layer's values another layer reads (glue is transparent), and where each layer is
    first seen in the graph."""
    glue_set = set(glue)
    producers = _glue_producers(glue, own)
    first_seen: dict[str, int] = {}
    for i, n in enumerate(nodes):
        if n in own:
            first_seen.setdefault(own[n], i)
    flow = nx.DiGraph()
    flow.add_nodes_from(first_seen)
    for n, layer in own.items():
        for p in n.all_input_nodes:
            for src in {own[p]} if p in own else producers.get(p, set()) if p in glue_set else set():
                if src != layer:
                    flow.add_edge(src, layer)
    return flow, first_seen


def _layer_order(
    flow: nx.DiGraph, first_seen: dict[str, int], assigner: LayerAssigner
) -> tuple[list[str], dict[str, tuple[Region, str]]]:
    """The pipeline order of the layers and their regions. Encoder work first wherever the data
    flow allows: transformers' VLMs embed the text before they run the vision tower, though
    neither reads the other, and a pipeline whose encoder layers lead can give the encoder a plan
    of its own (its work in the LLM's bubbles)."""
    try:
        seen_order = list(nx.lexicographical_topological_sort(flow, key=first_seen.__getitem__))
    except nx.NetworkXUnfeasible:
        cycle = nx.find_cycle(flow)
        raise RegionError(
            f"layers exchange values in a cycle {cycle}; the graph cannot be cut into a pipeline "
            "along these layers. Give region_overrides or restructure the modules involved."
        ) from None
    regions = regions_by_flow(seen_order, flow, assigner)
    encoder_first = {
        layer: (regions[layer][0] not in ENCODER_SIDE, first_seen[layer]) for layer in seen_order
    }
    order = list(nx.lexicographical_topological_sort(flow, key=encoder_first.__getitem__))
    return order, {layer: regions[layer] for layer in order}


def _place_glue(
    nodes: list[fx.Node], own: dict[fx.Node, str], glue: list[fx.Node], rank: dict[str, int], order: list[str]
) -> None:
    """Give every glue node a layer (in ``own``) so that every value flows forward in the layer
    order. A glue node joins the earliest layer that reads it; one no layer reads (the loss after
    the head, shape checks) joins the latest layer among its inputs', taken in graph order once
    the others are placed."""
    consumers: dict[fx.Node, set[str]] = {}
    for n in reversed(glue):
        consumers[n] = set().union(
            *([{own[u]} if u in own else consumers.get(u, set()) for u in n.users] or [set()])
        )
    for n in glue:
        if consumers[n]:
            own[n] = min(consumers[n], key=rank.__getitem__)
    for n in glue:
        if not consumers[n]:
            inputs = [own[p] for p in n.all_input_nodes if p in own]
            own[n] = max(inputs, key=rank.__getitem__) if inputs else order[0]
    for group in vmap_regions(nodes):
        _keep_together(group, own, rank)
    # A constant-index getitem joins the layer of the tuple it indexes (an earlier layer, so
    # values still flow forward): a multi-output node's tuple never crosses a layer boundary,
    # only its elements do, and codegen can cut at any layer boundary.
    for n in nodes:
        if (
            n.op == "call_function"
            and n.target is operator.getitem
            and n.all_input_nodes == [n.args[0]]
            and n.args[0] in own
        ):
            own[n] = own[n.args[0]]


_VMAP_ENTER = "_vmap_increment_nesting"
_VMAP_EXIT = "_vmap_decrement_nesting"


def vmap_regions(nodes: list[fx.Node]) -> list[list[fx.Node]]:
    """The nodes between a ``_vmap_increment_nesting`` and its ``_vmap_decrement_nesting``
    (transformers builds masks under vmap; export keeps the set-up and tear-down calls, which
    pass no value, so data flow alone would scatter them), outermost regions, in graph order."""
    groups: list[list[fx.Node]] = []
    depth = 0
    for n in nodes:
        name = getattr(n.target, "__name__", "") if n.op == "call_function" else ""
        if name == _VMAP_ENTER:
            if depth == 0:
                groups.append([])
            depth += 1
        if depth:
            groups[-1].append(n)
        if name == _VMAP_EXIT:
            depth -= 1
    return groups


def _keep_together(group: list[fx.Node], own: dict[fx.Node, str], rank: Mapping[str, int]) -> None:
    """Put a vmap region in one layer: the earliest that reads a value out of it (else the
    latest its values come from), so it still flows forward."""
    inside = set(group)
    readers = [own[u] for n in group for u in n.users if u not in inside and u in own]
    sources = [own[p] for n in group for p in n.all_input_nodes if p not in inside and p in own]
    if readers:
        layer = min(readers, key=rank.__getitem__)
    elif sources:
        layer = max(sources, key=rank.__getitem__)
    else:
        return
    latest_source = max(sources, key=rank.__getitem__) if sources else None
    if latest_source is not None and rank[latest_source] > rank[layer]:
        raise RegionError(
            f"a vmap region ({group[0].name} .. {group[-1].name}) reads from layer "
            f"{latest_source} and is read by the earlier layer {layer}; it cannot sit "
            "in one layer of the pipeline. Give region_overrides that keep those modules together"
        )
    for n in group:
        own[n] = layer


def check_regions_detected(regions: set[Region], *, overridden: bool, top_level: list[str]) -> None:
    """Without overrides, a VLM must show an encoder and a language part."""
    if overridden or (regions & ENCODER_REGIONS and regions & LANGUAGE_REGIONS):
        return
    found = ", ".join(sorted(r.value for r in regions))
    example = {name: "vision|projector|llm|head" for name in top_level[:4]}
    raise RegionError(
        f"could not detect the regions of this model (found only: {found}); a VLM needs a vision "
        f"encoder and a language model. Pass region_overrides, a mapping from module-path prefix to "
        f"region, e.g. region_overrides={example}"
    )
