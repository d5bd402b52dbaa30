"""The data every stage of the compiler hands the next: the LayerGraph, the Plan with its
actions and decisions, regions, the keys written into ``fx.Node.meta``, batch conventions and
the errors, and which rank holds each virtual stage (``placement``). The bottom layer: it
imports nothing else of vlmcompile."""
