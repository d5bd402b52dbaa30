"""One export of a model's code, configuration and shapes a process: a hit computes the new
model's own loss with its own tensors, and whatever an export depends on changes the key."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.models import needs_transformers
from vlmcompile.families import build_tiny_by_name
from vlmcompile.graph import export_memo
from vlmcompile.graph.export import LossOf, export_graph, is_data_dependent, takes_use_cache
from vlmcompile.graph.specialize import KnownValues

pytestmark = pytest.mark.usefixtures("memos")


def _counts() -> tuple[int, int]:
    return export_memo.stats["hits"], export_memo.stats["misses"]


def _llava(seed: int, **kwargs):
    """The tiny LLaVA (its builder seeds itself) with its weights moved by ``seed``'s noise."""
    model, batch = build_tiny_by_name("hf-llava", **kwargs)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=generator))
    root = LossOf(model, takes_use_cache(model))
    return root, {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}


@needs_transformers
def test_a_second_model_of_the_same_config_gets_the_graph_with_its_own_tensors():
    first, batch = _llava(0)
    export_graph(first, batch)
    hits, misses = _counts()
    second, _ = _llava(1)  # other weights: the graph must compute with them, not the first's
    gm, _ = export_graph(second, batch)
    assert _counts() == (hits + 1, misses)
    own = dict(second.named_parameters(remove_duplicate=False))
    assert all(p is own[name] for name, p in gm.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        torch.testing.assert_close(gm(**batch), second(**batch))
        assert not torch.allclose(gm(**batch), first(**batch))


@needs_transformers
def test_another_configuration_or_frozen_parameters_are_exported_again():
    root, batch = _llava(0)
    export_graph(root, batch)
    for changed in (
        _llava(0, attn_implementation="eager")[0],
        _llava(0)[0].requires_grad_(False),
    ):
        hits, misses = _counts()
        export_graph(changed, batch)
        assert _counts() == (hits, misses + 1)


class _Scaled(nn.Module):
    """A model whose graph holds a constant that is not a parameter or buffer."""

    def __init__(self, scale: float):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = torch.tensor(scale)  # lifted into the graph as a constant

    def forward(self, x):
        return (self.lin(x) * self.scale).sum()


class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, sizes):
        out = self.lin(x)
        return out.sum() if sizes.sum() > 4 else -out.sum()  # a branch on a tensor's value


def test_a_constants_value_and_a_known_value_are_in_the_key():
    x = {"x": torch.randn(2, 4)}
    export_graph(_Scaled(2.0), x)
    hits, misses = _counts()
    other = _Scaled(3.0)
    gm, _ = export_graph(other, x)
    assert _counts() == (hits, misses + 1)
    with torch.no_grad():
        torch.testing.assert_close(gm(**x), other(**x))
    export_graph(_Scaled(2.0), x)
    assert _counts() == (hits + 1, misses + 1)
    known = {"sizes": torch.tensor([3, 5])}

    class _Known(nn.Module):
        def __init__(self, fixed):
            super().__init__()
            self.inner, self.fixed = _Branchy(), fixed

        def forward(self, x):
            with KnownValues(self.fixed):
                return self.inner(x, **self.fixed)

    hits, misses = _counts()
    export_graph(_Known(known), x)
    export_graph(_Known({"sizes": torch.tensor([1, 2])}), x)
    assert _counts() == (hits, misses + 2)


def test_a_data_dependent_failure_is_remembered_and_raised_again():
    model, batch = _Branchy(), {"x": torch.randn(2, 4), "sizes": torch.tensor([3, 5])}
    with pytest.raises(Exception) as first:
        export_graph(model, batch)
    assert is_data_dependent(first.value)
    hits, misses = _counts()
    with pytest.raises(Exception) as again:
        export_graph(_Branchy(), batch)
    assert again.value is first.value and _counts() == (hits + 1, misses)


def test_torchs_shape_settings_are_in_the_key():
    import torch.fx.experimental._config as shape_config

    x = {"x": torch.randn(2, 4)}
    export_graph(_Scaled(2.0), x)
    hits, misses = _counts()
    with shape_config.patch(backed_size_oblivious=True):
        export_graph(_Scaled(2.0), x)
    assert _counts() == (hits, misses + 1)


def test_off_unless_asked_for(monkeypatch):
    monkeypatch.delenv(export_memo.MEMO_ENV)
    x = {"x": torch.randn(2, 4)}
    before = _counts()
    export_graph(_Scaled(2.0), x)
    export_graph(_Scaled(2.0), x)
    assert _counts() == before


class _Borrowing(nn.Module):
    """Holds a module outside its own tree, whose state the key could not describe."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.__dict__["other"] = nn.Linear(4, 4)  # an attribute, not a submodule

    def forward(self, x):
        return self.lin(x).sum()


def test_what_the_key_cannot_describe_is_exported_every_time():
    x = {"x": torch.randn(2, 4)}
    with pytest.raises(export_memo.Unkeyed, match="outside the model's modules"):
        export_memo.structure_key(_Borrowing(), x, None)
    before = _counts()
    for _ in range(2):
        gm, _ = export_graph(_Borrowing(), x)
    assert _counts() == before


def test_a_hit_holds_the_models_tensor_attributes_and_metadata_of_its_own():
    x = {"x": torch.randn(2, 4)}
    first = _Scaled(2.0)
    fresh, _ = export_graph(first, x)
    assert fresh.scale is first.scale  # what a fresh export holds: the model's own tensor
    second = _Scaled(2.0)
    hit, _ = export_graph(second, x)
    assert export_memo.stats["hits"] >= 1 and hit.scale is second.scale
    assert hit.state_dict().keys() == fresh.state_dict().keys()  # the constant is no buffer
    node = next(n for n in hit.graph.nodes if n.meta.get("nn_module_stack"))
    node.meta["nn_module_stack"].clear()  # a pass that changed a copy's metadata in place
    again, _ = export_graph(_Scaled(2.0), x)
    assert all(n.meta.get("nn_module_stack") for n in again.graph.nodes if n.name == node.name), (
        "the stored graph shares metadata with a copy it handed out"
    )


def test_a_torch_mode_or_a_default_device_leaves_the_model_unkeyed():
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Passing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    model, x = _Scaled(2.0), {"x": torch.randn(2, 4)}
    export_memo.structure_key(model, x, None)
    for context in (_Passing(), torch.device("meta")):  # the device is a torch function mode
        with context, pytest.raises(export_memo.Unkeyed, match="mode"):
            export_memo.structure_key(model, x, None)
