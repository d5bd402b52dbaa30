"""Training data as a VLM family sees it. Reads the IR only (and transformers, for the models it
packs).

* ``images`` - what one image becomes in each family: tiles or patches, and the LLM tokens standing for it.
* ``families`` - how a family lays out a sample's images, and the per-sample facts the packer needs.
* ``manifest`` - a user's dataset described without the data (JSONL, one sample a line).
* ``synthetic`` - seeded datasets whose sample sizes follow stated distributions.
* ``distribution`` - a dataset's samples as a pipeline will see them: token budget, microbatches, the mix.
* ``balance`` - OmniBal's balanced mini-batches (ISF) as a batch sampler, and its two measures.
* ``microbatches`` - a step's samples over microbatches and replicas, the LLM's and the encoder's work even.
* ``packing`` - samples packed into microbatches of a fixed token budget, per-sample attention and positions.
* ``packed_step`` - one packed microbatch as a transformers VLM trains on it, and the module capture takes once.
* ``steps`` - training steps of packed samples, the same on every rank, and the padded batch eager trains on.
"""
