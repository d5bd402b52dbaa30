"""FX-graph machinery behind the capture and annotate passes. Reads the IR.

* ``export`` - torch.export of (meta) models on fake CPU tensors, with the loss wrapper.
* ``export_memo`` - one export of a model's code, configuration and shapes a process (when asked for).
* ``annotate_memo`` - one annotation of a graph's code, tags, tensors and batch a process (asked for likewise).
* ``fake`` - fake tensors that claim the CPU, standing in for a model's meta or real tensors.
* ``specialize`` - a capture specialised on the batch values that decide shapes.
* ``layering`` - the captured graph's nodes grouped into layers, each with its region.
* ``subgraph`` - a run of a captured graph's nodes copied out as a module of its own.
* ``loss_split`` - whether the loss splits over microbatches (checked on the sample batch).
* ``contrastive`` - where a loss couples a batch's samples, and whether it is a contrastive loss we shard.
"""
