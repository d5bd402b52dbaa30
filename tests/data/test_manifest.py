"""A dataset described without the data: a JSONL manifest read, every fault named by line and
field, and its samples in a family's tokens."""

import pytest

from vlmcompile import families
from vlmcompile.data.manifest import ManifestSample, read_manifest, sample_size
from vlmcompile.ir.errors import DataError


def test_a_manifest_reads_into_samples_and_a_familys_tokens(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"text_tokens": 412, "images": [[768, 1024], [448, 448]]}\n\n{"text_tokens": 30}\n')
    samples = read_manifest(path)
    assert samples == [ManifestSample(412, ((768, 1024), (448, 448))), ManifestSample(30)]
    first = sample_size(samples[0], families.get("internvl").image_tokens)
    assert first.llm_tokens == 412 + sum(i.llm_tokens for i in first.images) and first.images[1].tiles == 1
    text_only = sample_size(samples[1], families.get("qwen2-vl").image_tokens)
    assert text_only.llm_tokens == 30 and text_only.patches == 0


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (
            '{"images": []}',
            r"m.jsonl:2: text_tokens=None; give the sample's text tokens as a positive integer",
        ),
        ('{"text_tokens": -3}', r"text_tokens=-3"),
        ('{"text_tokens": 5, "images": [[10]]}', r"m.jsonl:2: images\[0\]=\[10\]; give \[height, width\]"),
        ('{"text_tokens": 5, "images": [[10, -2]]}', r"images\[0\]=\[10, -2\]"),
        ('{"text_tokens": 5, "images": "a.png"}', r"images='a.png'; give a list"),
        ('{"text_tokens": 5, "pixels": 3}', r"unknown fields \['pixels'\]"),
        ("[1, 2]", r"a list; give an object"),
        ("{text_tokens: 5}", r"m.jsonl:2: not JSON"),
    ],
)
def test_every_fault_names_its_line_and_field(tmp_path, line, message):
    path = tmp_path / "m.jsonl"
    path.write_text('{"text_tokens": 1}\n' + line + "\n")
    with pytest.raises(DataError, match=message):
        read_manifest(path)


def test_an_empty_or_missing_manifest_is_refused(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match="holds no samples"):
        read_manifest(tmp_path / "empty.jsonl")
    with pytest.raises(DataError, match="cannot read manifest"):
        read_manifest(tmp_path / "missing.jsonl")
