"""The discrete-event simulator of a plan's action lists under the cost model (``simulator``):
the one timing rule (``timeline``), the data-parallel stream (``dp``), memory in flight
(``in_flight``), encoder kernels in TP gaps (``kernel_stream``), and its traces (``trace``:
Chrome trace, PNG). Reads the IR and the cost models."""
