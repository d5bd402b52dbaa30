"""Training data as a VLM family sees it: what one image becomes (tiles, patches, LLM tokens:
``images``), a user's dataset described without the data (a JSONL manifest: ``manifest``), how a
model family lays out a sample's images (``families``), seeded datasets with stated
distributions (``synthetic``), samples packed into microbatches of a fixed token budget with
per-sample attention and positions (``packing``), the packed microbatch as the model trains on it
and the module a pipeline captures once for all of them (``packed_step``), and the training
steps of packed samples (``steps``). Reads the IR only (and transformers, for the models it
packs)."""
