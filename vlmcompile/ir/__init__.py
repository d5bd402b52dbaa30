"""The data every stage of the compiler hands the next. The bottom layer: it imports nothing
else of vlmcompile.

* ``layer_graph`` - the LayerGraph every planning pass reads: layers with region and costs, edges with bytes.
* ``plan`` - the Plan: stages, degrees, microbatches, action lists, recompute, and the decisions with reasons.
* ``actions`` - one unit of pipeline work (a stage's forward or backward of a microbatch) and the order rules.
* ``program`` - a plan's action lists with their transfers lowered in: the sends and receives each rank issues.
* ``placement`` - which pipeline rank holds each virtual stage: the one placement rule.
* ``regions`` - a VLM's regions (vision, projector, LLM, head) and how a module path gets one.
* ``meta_keys`` - the keys vlmcompile writes into ``fx.Node.meta``.
* ``microbatch`` - a batch split into microbatches by sample, and each microbatch's share of the loss.
* ``packed`` - the packed layout a pipeline was captured for, and one step's packed microbatches.
* ``shape_plan`` - the shape of every value a stage sends, as a formula over a microbatch's input sizes.
* ``contrastive_loss`` - a contrastive loss that couples a batch's samples, as data, and its one formula.
* ``contrastive_plan`` - the plan of a contrastive two-tower step.
* ``errors`` - the errors raised for bad input, each naming the value at fault and what to do.
* ``gc_pause`` - Python's garbage collection paused over work that must not stall.
"""
