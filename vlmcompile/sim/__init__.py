"""The discrete-event simulator of a plan's action lists under the cost model. Reads the IR and
the cost models.

* ``simulator`` - a plan's step: every rank's actions, bubbles by cause, memory, MFU.
* ``timeline`` - the one timing rule: when each action of per-rank action lists runs.
* ``dp`` - the data-parallel collectives on one stream per rank.
* ``in_flight`` - the activations a rank holds while each of its actions runs.
* ``kernel_stream`` - encoder kernels inside the LLM's TP gaps (Optimus's ``AssignKernels``).
* ``trace`` - Chrome-trace JSON and PNG timelines of a simulated step.
* ``units`` - times as reports print them.
"""
