"""Export a corpus of real architectures with torch's dynamo exporter, for `pipeline_sweep.py`.

torch.onnx.export defaults to the dynamo exporter (torch >= 2.9), whose graphs differ from the
TorchScript exporter's: `Shape(start, end)`, Reshape with allowzero=1, unbind as Slice +
Squeeze, function ops such as Attention from opset 23, causal masks that fold to constants.
This writes timm, torchvision and Hugging Face models with random weights (no downloads; the
weights do not matter for mapping, quantizing and bit-exact compiling) and an INDEX.tsv with
their input shapes, so the sweep can be rerun:

    python bench/export_dynamo_models.py --out /tmp/dynamo_models [--only NAME ...]
    python bench/pipeline_sweep.py --models /tmp/dynamo_models --target mlsoc rk3588

Needs torch, torchvision, timm and transformers, which model-surgery itself does not depend
on: run it from a separate environment. A model that fails to export is listed with its error
and skipped (HF BEiT, Swin and T5 do not export with torch 2.14's dynamo exporter).
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Callable
from pathlib import Path

import timm
import torch
import torchvision
import transformers as hf
from corpus import earlier_rows, run_inputs_text, write_index

TIMM = [
    "resnet18",
    "mobilenetv3_small_100",
    "efficientnet_b0",
    "vit_tiny_patch16_224",
    "convnext_atto",
    "deit_tiny_patch16_224",
    "swin_tiny_patch4_window7_224",
    "levit_128s",
    "efficientformerv2_s0",
    "mobilevitv2_050",
    "poolformerv2_s12",
    "pvt_v2_b0",
    "regnety_002",
    "ghostnetv2_100",
    "repvit_m0_9",
    "fastvit_t8",
    "edgenext_xx_small",
    "tiny_vit_5m_224",
    "efficientvit_m0",
    "mobileone_s0",
    "convnextv2_atto",
    "caformer_s18",
    "hgnetv2_b0",
    "tf_efficientnet_lite0",
    "mixnet_s",
    "densenet121",
    "inception_v3:299",
    "xcit_nano_12_p16_224",
    "sequencer2d_s",
    "nfnet_l0",
    "coatnet_nano_rw_224",
    "hrnet_w18_small",
    "mobilenetv4_hybrid_medium:256",
    "efficientvit_b0",
    "eva02_tiny_patch14_224",
    "volo_d1_224",
]


class _FirstOutput(torch.nn.Module):
    """The model's first output (or logits) for one named input."""

    def __init__(self, model: torch.nn.Module, key: str | None) -> None:
        super().__init__()
        self.model, self.key = model.eval(), key

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.model(**{self.key: x}) if self.key else self.model(x)
        if isinstance(out, torch.Tensor):
            return out
        if hasattr(out, "logits"):
            return out.logits
        return out["out"] if isinstance(out, dict) and "out" in out else out[0]


Built = tuple[torch.nn.Module, torch.Tensor]
"""A module to export and its example input."""


def _hf(config: hf.PretrainedConfig, model_cls: Callable, key: str, shape: tuple) -> Built:
    example = torch.randint(0, 1000, shape) if key == "input_ids" else torch.randn(*shape)
    return _FirstOutput(model_cls(config), key), example


def hugging_face() -> dict[str, Callable[[], Built]]:
    """name → (module, example input) builders; small configs, random weights."""
    text = (1, 32)
    image = (1, 3, 224, 224)
    return {
        "hf_bert": lambda: _hf(
            hf.BertConfig(
                hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512
            ),
            hf.BertModel,
            "input_ids",
            text,
        ),
        "hf_gpt2": lambda: _hf(
            hf.GPT2Config(n_embd=128, n_layer=2, n_head=2), hf.GPT2Model, "input_ids", text
        ),
        "hf_llama": lambda: _hf(
            hf.LlamaConfig(
                hidden_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                intermediate_size=256,
                vocab_size=1000,
            ),
            hf.LlamaModel,
            "input_ids",
            text,
        ),
        "hf_distilbert": lambda: _hf(
            hf.DistilBertConfig(dim=128, n_layers=2, n_heads=2, hidden_dim=256),
            hf.DistilBertModel,
            "input_ids",
            text,
        ),
        "hf_clip_text": lambda: _hf(
            hf.CLIPTextConfig(
                hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256
            ),
            hf.CLIPTextModel,
            "input_ids",
            text,
        ),
        "hf_vit": lambda: _hf(
            hf.ViTConfig(
                hidden_size=192, num_hidden_layers=2, num_attention_heads=3, intermediate_size=384
            ),
            hf.ViTModel,
            "pixel_values",
            image,
        ),
        "hf_dinov2": lambda: _hf(
            hf.Dinov2Config(hidden_size=192, num_hidden_layers=2, num_attention_heads=3),
            hf.Dinov2Model,
            "pixel_values",
            image,
        ),
        "hf_convnext": lambda: _hf(
            hf.ConvNextConfig(hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 2, 1]),
            hf.ConvNextModel,
            "pixel_values",
            image,
        ),
        "hf_segformer": lambda: _hf(
            hf.SegformerConfig(
                hidden_sizes=[16, 32, 64, 128], decoder_hidden_size=64, num_labels=10
            ),
            hf.SegformerForSemanticSegmentation,
            "pixel_values",
            (1, 3, 256, 256),
        ),
        "hf_detr": lambda: _hf(
            hf.DetrConfig(
                use_timm_backbone=False,
                use_pretrained_backbone=False,
                backbone_config=hf.ResNetConfig(
                    depths=[1, 1, 1, 1], hidden_sizes=[32, 64, 128, 256], out_features=["stage4"]
                ),
                d_model=64,
                encoder_layers=1,
                decoder_layers=1,
                encoder_attention_heads=2,
                decoder_attention_heads=2,
                encoder_ffn_dim=128,
                decoder_ffn_dim=128,
                num_queries=20,
            ),
            hf.DetrForObjectDetection,
            "pixel_values",
            (1, 3, 320, 320),
        ),
        "hf_whisper_encoder": lambda: _hf(
            hf.WhisperConfig(
                d_model=64,
                encoder_layers=2,
                encoder_attention_heads=2,
                decoder_layers=1,
                decoder_attention_heads=2,
                encoder_ffn_dim=128,
                decoder_ffn_dim=128,
            ),
            lambda config: hf.WhisperModel(config).encoder,
            "input_features",
            (1, 80, 3000),
        ),
        "hf_wav2vec2": lambda: _hf(
            hf.Wav2Vec2Config(
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=2,
                intermediate_size=128,
                conv_dim=(32,) * 7,
            ),
            hf.Wav2Vec2Model,
            "input_values",
            (1, 16000),
        ),
        "hf_albert": lambda: _hf(
            hf.AlbertConfig(
                embedding_size=64,
                hidden_size=128,
                num_hidden_layers=4,
                num_attention_heads=2,
                intermediate_size=256,
                vocab_size=1000,
            ),
            hf.AlbertModel,
            "input_ids",
            text,
        ),
        "hf_deberta_v2": lambda: _hf(
            hf.DebertaV2Config(
                hidden_size=128,
                num_hidden_layers=2,
                num_attention_heads=2,
                intermediate_size=256,
                vocab_size=1000,
                relative_attention=True,
                pos_att_type=["p2c", "c2p"],
                position_buckets=64,
                max_relative_positions=-1,
                position_biased_input=False,
                norm_rel_ebd="layer_norm",
            ),
            hf.DebertaV2Model,
            "input_ids",
            text,
        ),
        "hf_mobilebert": lambda: _hf(
            hf.MobileBertConfig(
                hidden_size=128,
                num_hidden_layers=2,
                num_attention_heads=2,
                intermediate_size=128,
                embedding_size=64,
                intra_bottleneck_size=64,
                true_hidden_size=64,
                vocab_size=1000,
            ),
            hf.MobileBertModel,
            "input_ids",
            text,
        ),
        "hf_qwen2": lambda: _hf(
            hf.Qwen2Config(
                hidden_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                intermediate_size=256,
                vocab_size=1000,
            ),
            hf.Qwen2Model,
            "input_ids",
            text,
        ),
        "hf_wavlm": lambda: _hf(
            hf.WavLMConfig(
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=2,
                intermediate_size=128,
                conv_dim=(32,) * 7,
            ),
            hf.WavLMModel,
            "input_values",
            (1, 16000),
        ),
        "hf_yolos": lambda: _hf(
            hf.YolosConfig(
                hidden_size=192,
                num_hidden_layers=2,
                num_attention_heads=3,
                intermediate_size=384,
                num_detection_tokens=10,
            ),
            hf.YolosForObjectDetection,
            "pixel_values",
            (1, 3, 224, 224),
        ),
        "hf_mobilevit": lambda: _hf(
            hf.MobileViTConfig(
                hidden_sizes=[64, 80, 96],
                neck_hidden_sizes=[16, 16, 24, 48, 64, 80, 320],
                expand_ratio=2.0,
            ),
            hf.MobileViTModel,
            "pixel_values",
            (1, 3, 256, 256),
        ),
    }


class _FlowPair(torch.nn.Module):
    """RAFT on the two frames stacked along channels: (1, 6, H, W) → the last flow estimate."""

    def __init__(self, model: torch.nn.Module, updates: int) -> None:
        super().__init__()
        self.model, self.updates = model.eval(), updates

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, second = x[:, :3], x[:, 3:]
        return self.model(first, second, num_flow_updates=self.updates)[-1]


def torchvision_models() -> dict[str, Callable[[], Built]]:
    models = torchvision.models

    def image(module: torch.nn.Module, *shape: int) -> Built:
        return _FirstOutput(module, None), torch.randn(*(shape or (1, 3, 224, 224)))

    segmentation = {"weights": None, "weights_backbone": None, "num_classes": 10}
    return {
        "tv_shufflenet": lambda: image(models.shufflenet_v2_x0_5()),
        "tv_squeezenet": lambda: image(models.squeezenet1_1()),
        "tv_mnasnet": lambda: image(models.mnasnet0_5()),
        "tv_googlenet": lambda: image(models.googlenet(aux_logits=False, init_weights=True)),
        "tv_deeplabv3_mnv3": lambda: image(
            models.segmentation.deeplabv3_mobilenet_v3_large(**segmentation)
        ),
        "tv_lraspp_mnv3": lambda: image(
            models.segmentation.lraspp_mobilenet_v3_large(**segmentation)
        ),
        "tv_r3d_18": lambda: image(models.video.r3d_18(num_classes=10), 1, 3, 4, 64, 64),
        "tv_s3d": lambda: image(models.video.s3d(num_classes=10), 1, 3, 16, 224, 224),
        "tv_raft_small": lambda: (
            _FlowPair(models.optical_flow.raft_small(), updates=2),
            torch.randn(1, 6, 128, 128),
        ),
    }


def timm_models() -> dict[str, Callable[[], Built]]:
    builders = {}
    for spec in TIMM:
        name, _, res = spec.partition(":")
        size = int(res or 224)
        builders[name] = lambda name=name, size=size: (
            timm.create_model(name, pretrained=False, num_classes=100).eval(),
            torch.randn(1, 3, size, size),
        )
    return builders


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", nargs="*", help="export only these names")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    args.out.mkdir(parents=True, exist_ok=True)
    builders = {**timm_models(), **torchvision_models(), **hugging_face()}
    rows = earlier_rows(args.out)
    for name, build in builders.items():
        if args.only and name not in args.only:
            continue
        try:
            module, x = build()
            path = args.out / f"{name}.onnx"
            torch.onnx.export(
                module.eval(), (x,), str(path), dynamo=True, input_names=["x"], external_data=False
            )
            rows[path.name] = run_inputs_text({"x": list(x.shape)})
            print(f"ok    {name}", flush=True)
        except Exception as exc:  # noqa: BLE001 - report and go on with the next model
            print(f"FAIL  {name}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    write_index(args.out, rows)


if __name__ == "__main__":
    main()
