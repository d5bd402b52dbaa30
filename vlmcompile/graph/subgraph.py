"""A run of a captured graph's nodes copied out as a module of its own."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch.fx as fx


def extract(
    gm: fx.GraphModule,
    nodes: Sequence[fx.Node],
    outputs: Sequence[fx.Node],
    *,
    module_class: type[fx.GraphModule] = fx.GraphModule,
    class_name: str = "Subgraph",
) -> tuple[fx.GraphModule, list[fx.Node]]:
    """``nodes`` (in graph order) as a module returning ``outputs`` as a tuple; its arguments are
    the values ``nodes`` read from outside them, returned in argument order. The module keeps
    ``gm``'s attribute paths and shares its parameters."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inside = set(nodes)
    inputs: list[fx.Node] = []
    for n in nodes:
        for p in n.all_input_nodes:
            if p not in inside and p not in env:
                env[p] = graph.placeholder(p.name)
                env[p].meta = dict(p.meta)
                inputs.append(p)
        env[n] = graph.node_copy(n, lambda p: env[p])
    graph.output(tuple(env[o] for o in outputs))
    return module_class(gm, graph, class_name=class_name), inputs


def ancestors(nodes: Iterable[fx.Node], stop: Iterable[fx.Node] = ()) -> set[fx.Node]:
    """``nodes`` and every node they depend on, not walking past (nor including) ``stop``."""
    stop = set(stop)
    seen: set[fx.Node] = set()
    todo = [n for n in nodes if n not in stop]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(p for p in n.all_input_nodes if p not in stop)
    return seen
