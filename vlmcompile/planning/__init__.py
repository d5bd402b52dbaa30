"""The planning core: typed requests and results, the numbers a stage-cut choice is made from,
schedules (action lists), the CP-SAT stage-cut model, building a plan from a policy's choices,
and the papers' setups. Reads the IR, the cost models and the simulator; the policies that use
it live in ``passes/``."""
