import os

import pytest
import torch
from hypothesis import settings

# Property tests draw the same examples on every run: CI never fails on a lucky draw that a
# rerun would pass. HYPOTHESIS_PROFILE=explore draws new examples each run.
settings.register_profile("vlmcompile", derandomize=True, print_blob=True)
settings.register_profile("explore", max_examples=300, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "vlmcompile"))

# Many test files compile the same tiny families: each process exports a model of one code,
# configuration and shapes once, and annotates its graph once (vlmcompile/graph/export_memo.py,
# annotate_memo.py). Set before any rank server starts, so that the ranks and the command-line
# runs the tests start have it as well.
os.environ.setdefault("VLMCOMPILE_MEMO", "1")


SHARED_CAPTURES = frozenset(
    {
        "tests/test_transformers_vlms.py",
        "tests/passes/graph/test_annotate.py",
        "tests/passes/graph/test_capture.py",
        "tests/passes/codegen/test_stages.py",
    }
)
"""Test files that compile the same tiny transformers families at the same shapes (LLaVA,
Idefics3, PaliGemma, InternVL): CI runs them on one worker, one after the other, so that each is
exported once (vlmcompile/graph/export_memo.py is a memo of one process)."""


def _scope(path: str) -> str:
    """The unit CI's workers take: a test file, or the files that share captures."""
    return "shared captures" if path in SHARED_CAPTURES else path


def pytest_collection_modifyitems(config, items):
    """The heaviest test files first (tests/durations.json; the files that share captures as
    one), each file's tests in their order: CI's two workers take whole files (``--dist
    loadfile``) as they come free, so a long file started last would leave one worker idle while
    the other finishes it."""
    from tests.durations import weights

    seconds: dict[str, float] = {}
    for path, s in weights().items():
        seconds[_scope(path)] = seconds.get(_scope(path), 0.0) + s
    first_seen: dict[str, int] = {}
    for item in items:
        first_seen.setdefault(item.nodeid.split("::")[0], len(first_seen))

    def order(item):
        path = item.nodeid.split("::")[0]
        return -seconds.get(_scope(path), 0.0), _scope(path), first_seen[path]

    items.sort(key=order)


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` with the files of :data:`SHARED_CAPTURES` as one unit."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedCaptures(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _scope(super()._split_scope(nodeid))

    return SharedCaptures(config, log)


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
