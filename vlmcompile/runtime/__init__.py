"""Running a plan: the per-rank executor on torch.distributed and the local launcher. Reads
the IR and the stage modules codegen made; never runs a pass or reads a report."""
