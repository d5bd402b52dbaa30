"""The planning core: typed requests (``request``) and results (``result``), policies as data
(``policy``), the model read as the baselines build it and the one recompute ladder
(``model_parts``), the numbers a stage-cut choice is made from (``problem``) and its CP-SAT
model (``stage_cuts``), schedules (``schedules``) and the list schedulers' one clock
(``list_clock``), encoder plans beside the LLM's (``encoder_plans``) and the encoder-in-bubbles
scheduling problem (``bubble_schedule``), layers into stages (``chunks``), building a plan from
a policy's choices (``build``), Megatron-LM's view of a plan (``megatron_layout``) and the
papers' setups (``setups``). Reads the IR, the cost models and the simulator; the policies that
use it live in ``passes/``."""
