"""A user's own model and data, as ``vlmcompile plan --model my_qwen:build_model --data
my_qwen:samples`` imports them from the folder it runs in: a tiny Qwen2-VL built from its
transformers config with random weights (nothing of vlmcompile's), and samples as its processor
and a collator give them: 0-3 images of different sizes and 12-50 text tokens each."""

import torch
from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

IMAGE, VIDEO, START, END = 100, 101, 102, 103
PATCH, MERGE, FRAMES = 14, 2, 2


def build_model():
    config = Qwen2VLConfig(
        vision_config=dict(
            depth=2,
            embed_dim=32,
            hidden_size=32,
            num_heads=2,
            mlp_ratio=2,
            patch_size=PATCH,
            spatial_merge_size=MERGE,
            temporal_patch_size=FRAMES,
            in_channels=3,
        ),
        text_config=dict(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]},
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=START,
        vision_end_token_id=END,
    )
    torch.manual_seed(0)
    return Qwen2VLForConditionalGeneration._from_config(config, attn_implementation="sdpa").train()


def build_model_and_batch():
    """The model and one padded batch of two samples, as a user's first try has it."""
    model = build_model()
    first, second = samples(2, images=(1, 1))
    width = max(first["input_ids"].shape[1], second["input_ids"].shape[1])
    batch = {}
    for key in ("input_ids", "labels", "mm_token_type_ids", "attention_mask"):
        fill = -100 if key == "labels" else 0
        rows = [
            torch.nn.functional.pad(s[key], (0, width - s[key].shape[1]), value=fill) for s in (first, second)
        ]
        batch[key] = torch.cat(rows)
    batch["pixel_values"] = torch.cat([first["pixel_values"], second["pixel_values"]])
    batch["image_grid_thw"] = torch.cat([first["image_grid_thw"], second["image_grid_thw"]])
    return model, batch


def samples(count: int = 24, *, images=None, seed: int = 0) -> list[dict]:
    """``count`` samples: image k of a sample a grid of (1, 2a, 2b) patches, a and b in 1..3."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        n_images = images[i] if images is not None else i % 4
        text = int(torch.randint(12, 51, (1,), generator=g))
        ids = torch.randint(3, IMAGE - 1, (text,), generator=g).tolist()
        grids, pixels, spans = [], [], []
        for _ in range(n_images):
            h, w = (2 * int(torch.randint(1, 4, (1,), generator=g)) for _ in range(2))
            grids.append([1, h, w])
            pixels.append(torch.randn(h * w, 3 * FRAMES * PATCH * PATCH, generator=g))
            spans.append([START, *[IMAGE] * (h * w // MERGE**2), END])
        for k in reversed(range(n_images)):  # image k after the text's k-th quarter
            at = 1 + k * text // 4
            ids[at:at] = spans[k]
        input_ids = torch.tensor([ids])
        sample = {
            "input_ids": input_ids,
            "attention_mask": torch.ones_like(input_ids),
            "mm_token_type_ids": (input_ids == IMAGE).long(),
            "labels": torch.where(input_ids == IMAGE, -100, input_ids),
        }
        if grids:
            sample["pixel_values"] = torch.cat(pixels)
            sample["image_grid_thw"] = torch.tensor(grids)
        out.append(sample)
    return out
