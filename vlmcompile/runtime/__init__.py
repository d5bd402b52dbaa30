"""Running a plan on torch.distributed. Reads the IR and the stage modules codegen made; never
runs a pass or reads a report.

A step:

* ``stage`` - the stage modules codegen makes and the runtime runs.
* ``capabilities`` - what the runtime can run, and the one check a plan passes on its way to the ranks.
* ``executor`` - :class:`PipelineRunner`: one rank's share of a plan, its lowered list interpreted in order.
* ``batches`` - a step's batch checked, cut into this rank's microbatches, a packed batch's sizes bound.
* ``transport`` - sends and receives between two ranks: by tag (gloo) or in each pair's one order (NCCL).
* ``wire`` - which values cross ranks, their shape header, their wire form.
* ``groups`` - the process groups of a rank (data-parallel, tied parameters, transfer pairs), made in one place.
* ``split_backward`` - a backward split into I (input gradients) and W (weight gradients), as zero-bubble plans run it.
* ``run_ahead`` - forwards one batch ahead: their outputs kept for the next step.
* ``collectives`` - waits with a deadline, and the summed gradient all-reduce.
* ``gradients`` - a step's gradients: reduced apart from those held before, dropped where eager has none.
* ``autocast`` - mixed precision: forwards under autocast, one bf16 copy of a weight a step, dtypes checked.
* ``contrastive`` - one exact step of a two-tower model whose loss couples the global batch.

Training:

* ``global_batches`` - global batches from a dataset of samples, the same on every rank.
* ``train_loop`` - the loop a user keeps: optimizer, LR schedule, clipping, checkpoints, metrics.
* ``memory`` - each rank's peak tensor memory over a step, measured (GPU statistics, CPU allocator events).
* ``optimizers`` - the optimizer a rank trains with: whole (ZeRO-0) or its states sharded over DP (ZeRO-1).
* ``timed_steps`` - one step returning the gradients, and timed steps of runners (measured comparisons).
* ``checkpoint`` - checkpoints in DCP format, under the original model's names.
* ``checkpoint_dir`` - a run's checkpoint folder: checked first, held by one run, where a run starts.
* ``saves`` - what a run keeps of itself in its checkpoints besides the weights.
* ``preemption`` - stop requests (SIGTERM, SIGUSR1): finish the step, save, stop.

Ranks:

* ``launch`` - N local ranks (gloo over 127.0.0.1), or torchrun's.
* ``rank_server`` - a server local ranks fork from, so that they do not each import torch.
* ``rank_server_process`` - that server's own process.
"""
