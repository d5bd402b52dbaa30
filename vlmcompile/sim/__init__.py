"""The discrete-event simulator of a plan's action lists under the cost model, and its traces
(Chrome trace, PNG). Reads the IR and the cost models."""
