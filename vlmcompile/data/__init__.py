"""Training data as a VLM family sees it: what one image becomes (tiles, patches, LLM tokens:
``images``), a user's dataset described without the data (a JSONL manifest: ``manifest``), how a
model family lays out a sample's images (``families``), seeded datasets with stated
distributions (``synthetic``) and samples packed into microbatches of a fixed token budget with
per-sample attention and positions (``packing``). Reads the IR only."""
