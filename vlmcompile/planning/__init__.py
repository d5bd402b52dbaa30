"""The planning core. Reads the IR, the cost models and the simulator; the passes and baselines
that use it live in ``passes/``.

What a policy is asked and returns:

* ``request`` - :class:`PlanRequest` (degrees, batch, schedule) and the solvers' options.
* ``policy`` - a planning policy as data, the record the registry holds.
* ``result`` - what every policy returns: its plan simulated, with its report.
* ``build`` - from a policy's choices to a validated plan: stages, schedule, action lists.
* ``setups`` - the model, cluster and parallel configurations of the papers' setups.

Stage cuts and recompute (the partition pass):

* ``model_parts`` - a LayerGraph read as the baselines build a VLM; the one recompute ladder.
* ``chunks`` - layers into stages, and the balanced split of Optimus's appendix B.
* ``partition_problem`` - the numbers a stage-cut choice is made from, and what a choice costs.
* ``stage_cuts`` - stage cuts and per-layer recompute as one CP-SAT model.

Schedules and the encoders in the LLM's bubbles:

* ``schedules`` - pipeline schedules as action-list generators.
* ``list_clock`` - the one clock of the list schedulers.
* ``encoder_plans`` - the encoders on parallel plans of their own beside the LLM's.
* ``bubble_schedule`` - encoder work in the LLM's bubbles: the problem, the list scheduler (and its
  settings) and the CP-SAT model.
* ``per_batch`` - the encoder-in-bubbles schedule re-planned for every global batch.

Bounds (what no plan beats):

* ``step_bound`` - the step of every plan a candidate's degrees can reach.
* ``candidate_bound`` - a plan-search candidate's bounds from the cost model.
* ``partition_bound`` - bounds on the stage-cut CP-SAT models' objectives.
* ``cut_lagrangian`` - bounds over every contiguous cut, by Lagrangian relaxation.
* ``llm_alone_bound`` - the same LLM without its encoders at a plan's degrees.

Contrastive two-tower models:

* ``contrastive`` - samples per rank, microbatches and what a rank keeps.
* ``contrastive_placement`` - both towers on every rank, or each on ranks of its own.

And ``megatron_layout`` (Megatron-LM's view of a plan), ``forked`` (independent planning calls
on every core).
"""
