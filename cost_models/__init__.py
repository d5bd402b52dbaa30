"""Cost models: what a plan costs on a cluster. Installed as ``vlmcompile.cost_models``.

* ``cluster`` - :class:`Cluster`: devices, nodes and links; presets and ``cpu:<ranks>``.
* ``hardware`` - the device catalogue; a CPU's rates measured on the machine at hand.
* ``flops`` - analytic FLOP counts and the SDPA formulas torch's counter lacks.
* ``compute`` - a layer's compute time: a roofline per op class, summed.
* ``calibrate`` - the per-op-class efficiencies fitted to measured layer times.
* ``comm`` - ring collectives and point-to-point transfers (alpha-beta).
* ``memory`` - memory per rank: model states by precision and ZeRO stage, activations.
* ``stage_costs`` - what each stage of a plan costs: compute, TP communication, transfers, memory.
"""
