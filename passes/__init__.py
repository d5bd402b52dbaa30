"""Compiler passes, one per file.

| file                 | pass              | kind     | does |
|----------------------|-------------------|----------|------|
| capture.py           | capture           | graph    | model + sample batch -> fx.GraphModule, nodes tagged with layer and region; the loss-split check |
| capture_packed.py    | capture           | graph    | samples of different shapes: one capture for every packed microbatch, checked against eager on all of them |
| annotate.py          | annotate          | graph    | FLOPs (attention apart), memory traffic, saved bytes, parameter and boundary bytes per node and layer; the LayerGraph |
| profile.py           | profile           | graph    | every layer's forward and backward timed on the device at hand (the cost model's measured times) |
| partition.py         | partition         | planning | ours: stage cuts and per-layer recompute chosen together by CP-SAT, under every rank's memory |
| bubbles.py           | bubbles           | planning | ours: the encoders on a plan of their own, their work scheduled into the LLM's bubbles (layer and kernel level) |
| plan_search.py       | plan search       | planning | the parallel degrees (DP/TP/PP/v/microbatch): candidates pruned by bounds, the rest partitioned |
| llm_alone.py         | (the bound)       | planning | the same LLM without its encoders at a plan's degrees: the step no plan of the VLM there beats |
| megatron.py          | megatron          | baseline | Megatron-LM: the encoder with the first stage (LLaVA) or one chain, even split, global recompute |
| megatron_balanced.py | megatron_balanced | baseline | Megatron-LM with the Optimus appendix-B layer-balancing program over pp x v virtual stages |
| omnibal.py           | omnibal           | baseline | OmniBal: balanced stage cuts (anchor + jitter) and adaptive per-layer recompute |
| torchtitan_vlm.py    | torchtitan_vlm    | baseline | torchtitan's pipeline_vlm split, the encoder on stage 0, first_stage_less_layers tuned |
| mimo_colocated.py    | mimo_colocated    | baseline | Megatron MIMO's colocated layout: every module on every rank, no pipeline |
| codegen.py           | codegen           | codegen  | one module per stage of a plan, split out of the captured graph, recompute applied |
| codegen_towers.py    | codegen           | codegen  | a contrastive model's two tower modules and loss scalars, cut where capture found the coupled loss |
| policies.py          | (the registry)    | planning | every policy as a :class:`~vlmcompile.planning.policy.Policy`; run one, compare them, search |

Graph passes are built and run by :mod:`vlmcompile.compiler`; planning passes take the
LayerGraph, a :class:`vlmcompile.Cluster` and a request and return a plan with a report
(:mod:`vlmcompile.passes.policies` runs one and simulates its plan).
"""
