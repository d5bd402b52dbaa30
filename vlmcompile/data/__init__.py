"""Training data as a VLM family sees it: what one image becomes (tiles, patches, LLM tokens:
``images``) and a user's dataset described without the data (a JSONL manifest: ``manifest``).
Reads the IR only."""
