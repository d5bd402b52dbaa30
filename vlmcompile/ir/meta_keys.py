"""Keys under which vlmcompile writes into ``fx.Node.meta``, ``GraphModule.meta`` and ``LayerGraph.meta``.

torch's own keys (``val``, ``tensor_meta``, ``nn_module_stack``) are read, never written.
Tests import these constants rather than spelling the strings.
"""

LAYER_META = "vlmcompile.layer"
"""Name of the layer the node belongs to (a module path such as ``llm.blocks.3``), written by
capture and read as is by annotate and codegen; None for placeholders and the output."""

REGION_META = "vlmcompile.region"
"""The node's :class:`vlmcompile.ir.regions.Region`."""

NODE_COST_META = "vlmcompile.node_cost"
"""The node's :class:`vlmcompile.ir.layer_graph.NodeCost`, written by the annotate pass."""

LAYER_ORDER_META = "vlmcompile.layer_order"
"""On ``GraphModule.meta``: the layer names in pipeline order."""

BLOCK_LAYERS_META = "vlmcompile.block_layers"
"""On ``GraphModule.meta``: the layers that are repeated transformer blocks (see
:func:`vlmcompile.graph.layering.find_blocks`), a frozenset of layer names."""

SPECIALIZED_META = "vlmcompile.specialized"
"""On ``GraphModule.meta``: batch key -> the tensor whose values the graph is specialised on
(see :mod:`vlmcompile.graph.specialize`); absent when the graph holds for any values."""

PACKED_META = "vlmcompile.packed"
"""On ``GraphModule.meta``: the :class:`vlmcompile.ir.packed.PackedLayout` of a graph captured
once for packed microbatches with dynamic image sizes; absent otherwise."""

LOSS_SPLIT_META = "vlmcompile.loss_split"
"""On ``GraphModule.meta``: the :class:`vlmcompile.graph.loss_split.LossSplitCheck` of the
sample batch (whether microbatch losses add up to the batch's)."""

COUPLING_META = "vlmcompile.coupling"
"""On ``GraphModule.meta``, for a loss that couples the samples: the
:class:`vlmcompile.graph.contrastive.CouplingCut` (the contrastive loss found, or why none)."""

RUNTIME_CHECK_META = "vlmcompile.runtime_check"
"""True on a runtime assertion export inserted and on the nodes only it reads: run on real
tensors, skipped by annotate (fake tensors hold no values to check)."""

WRAPPER_PREFIX_META = "vlmcompile.wrapper_prefix"
"""On ``GraphModule.meta``: the attribute-path prefix capture's wrapper adds to the model's own
names (``"inner."`` for transformers models, which capture wraps to return the loss; else "")."""

CAPTURE_OPTIONS_META = "vlmcompile.capture_options"
"""On ``GraphModule.meta``: the keyword options capture ran with (region overrides, method, and
the inputs export specialised on, to try first), so that a capture again at a microbatch's size
(the runtime's) makes the same layers at the cost of one export."""

OUTPUT_META = "vlmcompile.output"
"""On ``GraphModule.meta``, set by annotate: the graph's output as annotate ran it (on fake or
real tensors); ``compile`` checks that it is a scalar loss."""

PROFILE_SPREAD_META = "profile_spread"
"""In ``LayerGraph.meta`` after the profile pass: (slowest - fastest round) / median round of its
timing, the share by which the measured times move with the machine's load; the plan search
calls two plans closer than it a tie within the noise."""
