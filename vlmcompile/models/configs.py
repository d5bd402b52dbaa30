"""Configurations of the reference zoo, and every model named in tests/reference/paper_setups.json.

Where a paper gives no value, the choice is ours and is stated next to it:

* Optimus GPT LLMs use the GPT-3 block (GELU MLP of width 4h, full multi-head attention) and
  the GPT-2/3 vocabulary of 50257; LLAMA-70B uses Llama-2-70B's (gated MLP 28672, 8 KV heads,
  vocabulary 32000).
* Optimus ViTs see 2048 tokens per sample: 2 images of 448 px in 14 px patches (2 x 1024
  tokens), reduced by pixel shuffle 2 to 2 x 256 LLM tokens, + 1536 text tokens = the 2048-token
  LLM sequence. How we derived it: appendix A uses sequence length 2048 in every experiment,
  and section 2.3 quotes a ViT-22B layer at ~1.4 ms forward. At microbatch 2 and TP 8 with
  2048 tokens per sample that layer's matmuls are 2 x 2048 x 2 (4 h^2 + 2 h mlp) / 8 = 4.6e11
  FLOP per GPU, 0.47 ms at the H100's 989 TFLOP/s: 1.4 ms is a third of peak, what a
  Megatron layer with its TP collectives shows. With 256 tokens (one 224 px image) the same
  layer would be 0.06 ms at peak, and 1.4 ms would be 4 % of it.
* InternViT-6B sees 448 px tiles in 14 px patches (1024 tokens), reduced to 256 LLM tokens by
  pixel shuffle (factor 2); an OmniBal VLM sample is 9 tiles in a 4096-token LLM sequence
  (Q_v = 9, Q_t = 4096 in the OmniBal dataset settings). InternViT's QK-norm and layer scale
  are left out: they add no matmul FLOPs.
* DistMM towers use heads of 64 (width <= 1536) or 128 dims, except width 5140, which only
  20 heads of 257 divide; MLP width 4h; 336 px images in 14 px patches; 77 text tokens with
  CLIP's vocabulary of 49408. CoCa and LiT are modelled as contrastive pairs (their
  captioning decoder and frozen tower are not modelled).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, kw_only=True, slots=True)
class ViTConfig:
    """A vision transformer encoder."""

    name: str
    width: int
    depth: int
    mlp: int
    heads: int
    head_dim: int
    image_px: int = 224
    """Side of the square input image in pixels."""
    patch: int = 14
    """Side of a square patch in pixels; tokens per image = (image_px / patch)^2."""
    channels: int = 3
    family: Literal["optimus", "omnibal", "distmm", "tiny"] = "tiny"
    """Which paper's input conventions a VLM built on this encoder follows."""

    def __post_init__(self):
        if self.image_px % self.patch:
            raise ValueError(f"{self.name}: image_px={self.image_px} is not a multiple of patch={self.patch}")

    @property
    def grid(self) -> int:
        return self.image_px // self.patch

    @property
    def tokens_per_image(self) -> int:
        return self.grid**2


@dataclass(frozen=True, kw_only=True, slots=True)
class LLMConfig:
    """A decoder-only language model."""

    name: str
    width: int
    depth: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    vocab: int
    gated_mlp: bool = True
    """Llama's SiLU-gated MLP (3 matrices) when True, GPT-3's GELU MLP (2 matrices) when False."""
    tie_embeddings: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class ProjectorConfig:
    pixel_shuffle: int = 1
    """Token-reduction factor r: r x r neighbouring patches become one token (1 = none)."""
    hidden: int | None = None
    """Hidden width of the projector MLP; None means the LLM's width."""


@dataclass(frozen=True, kw_only=True, slots=True)
class VLMConfig:
    """Encoder(s) + projector(s) + LLM; image tokens come before text tokens in the LLM sequence."""

    name: str
    encoders: tuple[ViTConfig, ...]
    projectors: tuple[ProjectorConfig, ...]
    llm: LLMConfig
    images_per_sample: int
    llm_tokens: int
    """Total LLM sequence length per sample: image tokens + text tokens."""

    def __post_init__(self):
        if len(self.encoders) != len(self.projectors):
            raise ValueError(
                f"{self.name}: {len(self.encoders)} encoders but {len(self.projectors)} projectors"
            )
        for enc, proj in zip(self.encoders, self.projectors):
            if enc.grid % proj.pixel_shuffle:
                raise ValueError(
                    f"{self.name}: pixel shuffle {proj.pixel_shuffle} does not divide the {enc.grid}x{enc.grid} "
                    f"patch grid of {enc.name}"
                )
        if len({(e.image_px, e.channels) for e in self.encoders}) != 1:
            raise ValueError(f"{self.name}: all encoders must read the same image size")
        if self.text_tokens < 2:
            raise ValueError(
                f"{self.name}: {self.image_tokens} image tokens leave {self.text_tokens} text tokens in a "
                f"{self.llm_tokens}-token sequence; raise llm_tokens to at least {self.image_tokens + 2}"
            )

    @property
    def image_tokens(self) -> int:
        per_image = sum(
            e.tokens_per_image // p.pixel_shuffle**2 for e, p in zip(self.encoders, self.projectors)
        )
        return per_image * self.images_per_sample

    @property
    def text_tokens(self) -> int:
        return self.llm_tokens - self.image_tokens


@dataclass(frozen=True, kw_only=True, slots=True)
class TextEncoderConfig:
    name: str
    width: int
    depth: int
    heads: int
    head_dim: int
    mlp: int
    vocab: int = 49408
    tokens: int = 77


@dataclass(frozen=True, kw_only=True, slots=True)
class ContrastiveConfig:
    """A CLIP-style image/text pair trained with a contrastive loss."""

    name: str
    vision: ViTConfig
    text: TextEncoderConfig
    embed_dim: int = 512


ModelConfig = ViTConfig | LLMConfig | TextEncoderConfig | VLMConfig | ContrastiveConfig


def _vit(name, width, depth, mlp, heads, head_dim=128, **kw) -> ViTConfig:
    return ViTConfig(name=name, width=width, depth=depth, mlp=mlp, heads=heads, head_dim=head_dim, **kw)


ENCODERS: dict[str, ViTConfig] = {
    c.name: c
    for c in (
        # Optimus Table 8 (ViT configurations); 448 px images (see the module docstring).
        _vit("ViT-3B", 2304, 48, 9216, 18, image_px=448, family="optimus"),
        _vit("ViT-5B", 3072, 48, 12288, 24, image_px=448, family="optimus"),
        _vit("ViT-11B", 4096, 48, 16384, 32, image_px=448, family="optimus"),
        _vit("ViT-22B", 6144, 48, 24576, 48, image_px=448, family="optimus"),
        # OmniBal: InternViT-6B (45 layers, width 3200, 25 heads of 128).
        _vit("InternViT-6B", 3200, 45, 12800, 25, image_px=448, family="omnibal"),
        # Tiny encoders for tests.
        _vit("tiny-vit", 32, 2, 64, 2, head_dim=16, image_px=16, patch=4),
        _vit("tiny-vit-coarse", 24, 2, 48, 2, head_dim=12, image_px=16, patch=8),
    )
}


def _llm(name, width, depth, heads, kv_heads, mlp, vocab, head_dim=128, **kw) -> LLMConfig:
    return LLMConfig(
        name=name,
        width=width,
        depth=depth,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        mlp=mlp,
        vocab=vocab,
        **kw,
    )


# fmt: off
LLMS: dict[str, LLMConfig] = {
    c.name: c
    for c in (
        #    name             width  depth heads kv  mlp        vocab
        _llm("GPT-11B",        3072,  80,  24,  24,  4 * 3072,  50257, gated_mlp=False),
        _llm("LLAMA-70B",      8192,  80,  64,   8,  28672,     32000),
        _llm("GPT-175B",      12288,  96,  96,  96,  4 * 12288, 50257, gated_mlp=False),
        _llm("InternLM2-20B",  6144,  48,  48,   8,  16384,     92544),
        _llm("Llama3-8B",      4096,  32,  32,   8,  14336,    128256),
        _llm("Yi-34B",         7168,  60,  56,   8,  20480,     64000),
        _llm("Llama3-70B",     8192,  80,  64,   8,  28672,    128256),
        _llm("Qwen1.5-110B",   8192,  80,  64,   8,  49152,    152064),
        _llm("tiny-llm",         32,   2,   4,   2,  64,           64, head_dim=8),
        _llm("tiny-llm-tied",    32,   2,   4,   4,  64,           64, head_dim=8, tie_embeddings=True),
    )
}
# fmt: on


def narrowed(cfg: ContrastiveConfig) -> ContrastiveConfig:
    """``cfg`` with the same layers and tiny widths: the same graph and layer names, small
    enough to run on real tensors (capture recognises a contrastive loss on it for the
    paper-size model, which is built on the meta device)."""
    return dataclasses.replace(
        cfg,
        name=f"{cfg.name}-narrow",
        vision=dataclasses.replace(
            cfg.vision, width=32, mlp=64, heads=2, head_dim=16, image_px=2 * cfg.vision.patch
        ),
        text=dataclasses.replace(cfg.text, width=32, mlp=64, heads=2, head_dim=16, vocab=64, tokens=8),
        embed_dim=16,
    )


def _distmm_heads(width: int) -> tuple[int, int]:
    """(heads, head_dim) for a DistMM tower width."""
    if width == 5140:
        return 20, 257
    head_dim = 64 if width <= 1536 else 128
    return width // head_dim, head_dim


def _distmm_pair(name: str, vision: tuple[int, int], text: tuple[int, int]) -> ContrastiveConfig:
    (v_depth, v_width), (t_depth, t_width) = vision, text
    v_heads, v_hd = _distmm_heads(v_width)
    t_heads, t_hd = _distmm_heads(t_width)
    return ContrastiveConfig(
        name=name,
        vision=_vit(
            f"{name}/vision", v_width, v_depth, 4 * v_width, v_heads, v_hd, image_px=336, family="distmm"
        ),
        text=TextEncoderConfig(
            name=f"{name}/text", width=t_width, depth=t_depth, heads=t_heads, head_dim=t_hd, mlp=4 * t_width
        ),
        embed_dim=1024,
    )


# DistMM's CLIP / CoCa / LiT sizes: (layers, hidden) of the vision and the text tower.
_DISTMM = {
    "CLIP": [((24, 1536), (24, 1024)), ((32, 4096), (32, 2560)), ((40, 5140), (32, 4096))],
    "CoCa": [((24, 1536), (24, 1536)), ((32, 4096), (32, 4096)), ((40, 5140), (40, 5140))],
    "LiT": [((24, 1024), (24, 1536)), ((32, 2560), (32, 4096)), ((32, 4096), (40, 5140))],
}

# Defaults a composed VLM takes from its (first) encoder's family: images per sample, LLM
# sequence length, pixel shuffle.
_FAMILY_INPUTS = {
    "optimus": (2, 2048, 2),
    "omnibal": (9, 4096, 2),
    "distmm": (1, 2048, 1),
    "tiny": (1, 12, 2),
}


def _base(component: str) -> str:
    """A component's zoo name without its ``:DEPTH``."""
    return component.rsplit(":", 1)[0]


def _tower(component: str, zoo: dict):
    """A zoo tower by name; ``NAME:DEPTH`` is the same tower with DEPTH layers (the plan search
    at scale: a 100-layer ViT, a 200-layer LLM)."""
    base, _, depth = component.partition(":")
    if not depth:
        return zoo[base]
    if not depth.isdigit() or int(depth) < 1:
        raise KeyError(
            f"{component!r}: the depth after ':' must be a whole number of layers >= 1, e.g. {base}:100"
        )
    return dataclasses.replace(zoo[base], name=component, depth=int(depth))


def compose(
    encoders: list[str] | tuple[str, ...],
    llm: str,
    *,
    name: str | None = None,
    images_per_sample: int | None = None,
    llm_tokens: int | None = None,
    pixel_shuffle: int | None = None,
) -> VLMConfig:
    """A VLM from named encoder(s) and LLM, with input sizes from the encoder's paper."""
    unknown = [e for e in encoders if _base(e) not in ENCODERS] + ([llm] if _base(llm) not in LLMS else [])
    if unknown:
        raise KeyError(
            f"unknown component(s) {unknown}; encoders: {sorted(ENCODERS)}; LLMs: {sorted(LLMS)} "
            "(each may take ':DEPTH' for another number of layers, e.g. ViT-5B:100)"
        )
    encs = tuple(_tower(e, ENCODERS) for e in encoders)
    images, tokens, shuffle = _FAMILY_INPUTS[encs[0].family]
    shuffle = pixel_shuffle if pixel_shuffle is not None else shuffle
    return VLMConfig(
        name=name or "+".join([*encoders, llm]),
        encoders=encs,
        projectors=tuple(
            ProjectorConfig(pixel_shuffle=shuffle if e.grid % shuffle == 0 else 1) for e in encs
        ),
        llm=_tower(llm, LLMS),
        images_per_sample=images_per_sample or images,
        llm_tokens=llm_tokens or tokens,
    )


DEMO = VLMConfig(
    name="demo",
    encoders=(_vit("demo-vit", 256, 4, 1024, 4, head_dim=64, image_px=224, patch=14),),
    projectors=(ProjectorConfig(pixel_shuffle=2),),
    llm=LLMConfig(
        name="demo-llm", width=384, depth=8, heads=6, kv_heads=2, head_dim=64, mlp=1024, vocab=2048
    ),
    images_per_sample=4,
    llm_tokens=384,
)
"""Small enough to train a step on a laptop CPU in about a second, with the forward-FLOP
share per region of InternVL-Chat-1.5 (see :mod:`vlmcompile.models` for the figures)."""

VLMS: dict[str, VLMConfig | ContrastiveConfig] = {
    c.name: c
    for c in (
        compose(["tiny-vit"], "tiny-llm", name="tiny"),
        compose(["tiny-vit"], "tiny-llm-tied", name="tiny-tied"),
        compose(["tiny-vit", "tiny-vit-coarse"], "tiny-llm", name="tiny-two-encoder", llm_tokens=16),
        ContrastiveConfig(
            name="tiny-contrastive",
            vision=ENCODERS["tiny-vit"],
            text=TextEncoderConfig(
                name="tiny-text", width=24, depth=2, heads=2, head_dim=12, mlp=48, vocab=64, tokens=8
            ),
            embed_dim=16,
        ),
        DEMO,
        compose(["InternViT-6B"], "InternLM2-20B", name="InternVL-Chat-1.5"),
        *(
            compose([w["encoder"]], w["llm"], name=f"Optimus-{w['name'].replace(' ', '-')}")
            for w in (
                {"name": "Model A", "encoder": "ViT-11B", "llm": "LLAMA-70B"},
                {"name": "Model B", "encoder": "ViT-22B", "llm": "LLAMA-70B"},
                {"name": "Model C", "encoder": "ViT-11B", "llm": "GPT-175B"},
                {"name": "Model D", "encoder": "ViT-22B", "llm": "GPT-175B"},
            )
        ),
        *(
            _distmm_pair(f"{family}-{size}", vision, text)
            for family, sizes in _DISTMM.items()
            for size, (vision, text) in zip("SML", sizes)
        ),
    )
}


def resolve(name: str) -> ModelConfig:
    """The configuration a zoo name stands for: a VLM, ``ENC[+ENC]+LLM``, or one tower; a
    component may take ``:DEPTH`` (``ViT-5B:100+GPT-11B:200``)."""
    if name in VLMS:
        return VLMS[name]
    if "+" in name:
        *encoders, llm = name.split("+")
        return compose(encoders, llm)
    if _base(name) in ENCODERS:
        return _tower(name, ENCODERS)
    if _base(name) in LLMS:
        return _tower(name, LLMS)
    raise KeyError(
        f"unknown model {name!r}; use a VLM name ({', '.join(sorted(VLMS))}), a composition "
        f"'ENCODER+LLM' of encoders ({', '.join(sorted(ENCODERS))}) and LLMs ({', '.join(sorted(LLMS))}), "
        f"or one of those towers alone; for your own model: --model pkg.module:function on the command line (a "
        "function returning the model, or the model and a sample batch), vlmcompile.compile(model, batch, cluster) "
        "in Python"
    )
