"""Compiler passes, one per file.

| file          | pass      | kind     | does                                                        |
|---------------|-----------|----------|-------------------------------------------------------------|
| capture.py    | capture   | graph    | model + sample batch -> fx.GraphModule, nodes tagged with layer and region |
| annotate.py   | annotate  | graph    | FLOPs (attention apart), memory traffic, saved bytes, parameter and boundary bytes per node and layer; the LayerGraph |
| megatron.py   | megatron  | planning | Megatron-LM's LLaVA plan: encoder + embedding on stage 0, L/(pp v) decoder layers per stage, global recompute; its `--pipeline-model-parallel-layout` |
| megatron_balanced.py | megatron_balanced | planning | the Optimus appendix-B layer-balancing DP over pp x v virtual stages |

Graph passes are built and run by :mod:`vlmcompile.compiler`; planning passes take the
LayerGraph, a :class:`vlmcompile.Cluster` and keyword options and return a plan with a report
(:mod:`vlmcompile.passes.policies` runs one and simulates its plan).
"""
