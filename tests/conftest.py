import os

import pytest
import torch
from hypothesis import settings

# Property tests draw the same examples on every run: CI never fails on a lucky draw that a
# rerun would pass. HYPOTHESIS_PROFILE=explore draws new examples each run.
settings.register_profile("vlmcompile", derandomize=True, print_blob=True)
settings.register_profile("explore", max_examples=300, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "vlmcompile"))


def pytest_collection_modifyitems(config, items):
    """The heaviest test files first (tests/durations.json), each file's tests in their order:
    CI's two workers take whole files (``--dist loadfile``) as they come free, so a long file
    started last would leave one worker idle while the other finishes it."""
    from tests.durations import weights

    seconds = weights()
    first_seen: dict[str, int] = {}
    for item in items:
        first_seen.setdefault(item.nodeid.split("::")[0], len(first_seen))
    items.sort(key=lambda item: (-seconds.get(path := item.nodeid.split("::")[0], 0.0), first_seen[path]))


@pytest.fixture(autouse=True)
def _single_thread_and_seed():
    # Deterministic and gentle on a shared 2-core machine.
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def demo_graph():
    """The demo VLM's LayerGraph, annotated on meta tensors (bf16, one sample)."""
    from vlmcompile.compiler import zoo_layer_graph

    return zoo_layer_graph("demo")


@pytest.fixture(scope="session")
def two_encoder_graph():
    import vlmcompile
    from vlmcompile import models

    model = models.build("tiny-two-encoder", device="meta")
    batch = models.sample_batch("tiny-two-encoder", batch_size=2, device="meta")
    return vlmcompile.compile(model, batch, model_name="tiny-two-encoder", log=None).layer_graph
