"""``--model`` and ``--data`` naming a user's function (``pkg.module:function``), next to zoo
names: what each builds, and the mistakes named."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vlmcompile import model_source
from vlmcompile.ir.errors import DataError, ModelError


def test_what_names_a_function_and_what_does_not(tmp_path, monkeypatch):
    assert model_source.is_function("my_vlm:build_model") and model_source.is_function("pkg.mod:f")
    assert not model_source.is_function("synthetic:llava-chat")
    assert not model_source.is_function("demo") and not model_source.is_function("ViT-22B+GPT-175B")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a:b").write_text("")  # a file of that name is the file
    assert not model_source.is_function("a:b")


def test_a_zoo_name_builds_its_model_and_batch_and_a_function_its_own(monkeypatch):
    zoo = model_source.build("tiny", batch_size=3)
    assert isinstance(zoo.model, nn.Module) and zoo.batch["input_ids"].shape[0] == 3
    own = model_source.build("tests.user_code.my_qwen:build_model_and_batch")
    assert type(own.model).__name__ == "Qwen2VLForConditionalGeneration" and own.model.training
    assert own.batch["input_ids"].shape[0] == 2
    assert [s["image_grid_thw"].shape[0] for s in own.samples] == [1, 1]  # a Qwen dict batch trains packed
    assert model_source.build("tests.user_code.my_llava:build_model_and_batch").samples is None
    alone = model_source.build("tests.user_code.my_qwen:build_model", dtype=torch.bfloat16)
    assert alone.batch is None and next(alone.model.parameters()).dtype == torch.bfloat16
    data = model_source.data("tests.user_code.my_qwen:samples", alone.model, num_samples=8)
    assert len(data) == 24 and {"input_ids", "labels"} <= set(data[1])


def test_the_same_seed_builds_the_same_weights_on_every_rank():
    one = model_source.build("tiny", seed=3).model.state_dict()
    two = model_source.build("tiny", seed=3).model.state_dict()
    assert all(torch.equal(one[k], two[k]) for k in one)


@pytest.mark.parametrize(
    ("spec", "error", "message"),
    [
        ("no_such_vlm:build", ModelError, "no module 'no_such_vlm' in"),
        (
            "tests.user_code.my_qwen:bild_model",
            ModelError,
            "did you mean tests.user_code.my_qwen:build_model?",
        ),
        ("tests.user_code.my_qwen:samples", ModelError, "returned a list; return the model (an nn.Module)"),
        ("no-such-zoo-model", ModelError, "for your own model: --model pkg.module:function"),
    ],
)
def test_a_model_that_cannot_be_built_is_named_with_the_fix(spec, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)").replace("?", r"\?")):
        model_source.build(spec)


def test_data_that_is_no_dataset_or_scaled_is_refused():
    model = nn.Linear(2, 2)
    with pytest.raises(DataError, match="returned a Qwen2VLForConditionalGeneration; return a dataset"):
        model_source.dataset("tests.user_code.my_qwen:build_model")
    with pytest.raises(DataError, match="drop --text-scale"):
        model_source.data("tests.user_code.my_qwen:samples", model, num_samples=4, text_scale=0.5)


def test_a_users_module_or_function_that_fails_is_named_not_called_our_bug(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "broken_vlm.py").write_text("raise RuntimeError('no weights here')\n")
    (tmp_path / "raising_vlm.py").write_text("def build():\n    raise ValueError('bad config')\n")
    with pytest.raises(ModelError, match=r"importing broken_vlm failed: RuntimeError: no weights here"):
        model_source.build("broken_vlm:build")
    with pytest.raises(ModelError, match=r"--model raising_vlm:build raised ValueError: bad config"):
        model_source.build("raising_vlm:build")
    with pytest.raises(DataError, match=r"--data raising_vlm:build raised ValueError: bad config"):
        model_source.dataset("raising_vlm:build")


def test_every_generator_is_seeded_before_a_users_function_so_ranks_build_alike(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "numpy_vlm.py").write_text(
        "import random, numpy, torch\n"
        "def build():\n"
        "    model = torch.nn.Linear(2, 2)\n"
        "    with torch.no_grad():\n"
        "        model.weight.fill_(float(numpy.random.rand()) + random.random())\n"
        "    return model\n"
    )
    first, second = (model_source.build("numpy_vlm:build", seed=5).model for _ in range(2))
    assert torch.equal(first.weight, second.weight)
    assert not torch.equal(first.weight, model_source.build("numpy_vlm:build", seed=6).model.weight)
