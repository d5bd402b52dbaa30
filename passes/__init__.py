"""Compiler passes, one per file, in folders by phase (the order a compile runs them).

| folder / file                  | pass              | does |
|--------------------------------|-------------------|------|
| graph/capture.py               | capture           | model + sample batch -> fx.GraphModule, nodes tagged with layer and region; the loss-split check |
| graph/capture_packed.py        | capture           | samples of different shapes: one capture for every packed microbatch, checked against eager on all of them |
| graph/annotate.py              | annotate          | FLOPs (attention apart), memory traffic, saved bytes, parameter and boundary bytes per node and layer; the LayerGraph |
| graph/profile.py               | profile           | every layer's forward and backward timed on the device at hand (the cost model's measured times) |
| planning/partition.py          | partition         | ours: stage cuts and per-layer recompute chosen together by CP-SAT, under every rank's memory |
| planning/bubbles.py            | bubbles           | ours: the encoders on a plan of their own, their work scheduled into the LLM's bubbles (layer and kernel level) |
| planning/plan_search.py        | plan search       | the parallel degrees (DP/TP/PP/v/microbatch): candidates pruned by bounds, the rest partitioned |
| planning/policies.py           | (the registry)    | every policy as a :class:`~vlmcompile.planning.policy.Policy`; run one, compare them, search |
| baselines/megatron.py          | megatron          | Megatron-LM: the encoder with the first stage (LLaVA) or one chain, even split, global recompute |
| baselines/megatron_balanced.py | megatron_balanced | Megatron-LM with the Optimus appendix-B layer-balancing program over pp x v virtual stages |
| baselines/omnibal.py           | omnibal           | OmniBal: balanced stage cuts (anchor + jitter) and adaptive per-layer recompute |
| baselines/torchtitan_vlm.py    | torchtitan_vlm    | torchtitan's pipeline_vlm split, the encoder on stage 0, first_stage_less_layers tuned |
| baselines/mimo_colocated.py    | mimo_colocated    | Megatron MIMO's colocated layout: every module on every rank, no pipeline |
| codegen/stages.py              | codegen           | one module per stage of a plan, split out of the captured graph, recompute applied |
| codegen/contrastive.py         | codegen           | a contrastive model's two tower modules and loss scalars, cut where capture found the loss |

Graph passes are built and run by :mod:`vlmcompile.compiler`; planning passes and baselines take
the LayerGraph, a :class:`vlmcompile.Cluster` and a request and return a plan with a report
(:mod:`vlmcompile.passes.planning.policies` runs one and simulates its plan). The bound every plan
is measured against, the same LLM without its encoders, lives with the other bounds:
:mod:`vlmcompile.planning.llm_alone_bound`.
"""
