"""FX-graph machinery behind the capture and annotate passes: torch.export of meta models,
fake tensors, specialisation on shape-deciding values, node-to-layer grouping and the loss
split check. Reads the IR."""
