"""Cost models: FLOP formulas now; compute, communication and memory models follow."""
