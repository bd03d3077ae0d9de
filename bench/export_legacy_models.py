"""Export a corpus of real architectures with torch's legacy TorchScript exporter
(`torch.onnx.export(..., dynamo=False)`), for `pipeline_sweep.py`.

The TorchScript exporter's graphs differ from the dynamo exporter's: Shape -> Gather ->
Unsqueeze -> Concat chains feeding Reshape, LayerNorm decomposed into ReduceMean/Sub/Pow/Sqrt/Div
below opset 17, GELU as Erf (or Tanh) arithmetic, Expand/Where attention masks, Pad with sizes
computed from shapes, LSTM/GRU with their own weight layout. This writes timm, torchvision,
Hugging Face and a few hand-written OCR models with random weights at opsets 11, 13 and 17,
some with dynamic batch/sequence axes, and an INDEX.tsv with the concrete run shapes:

    python bench/export_legacy_models.py --out /tmp/legacy_models [--only NAME ...]
    python bench/pipeline_sweep.py --models /tmp/legacy_models --target mlsoc rk3588

Needs torch, torchvision, timm and transformers, which model-surgery itself does not depend on:
run it from a separate environment (as for export_dynamo_models.py). A model that fails to
export is listed with its error and skipped. Weights get a little noise on top of their init:
default init leaves biases at 0 and norm scales at 1, which `remove-identity` rightly deletes
as x + 0 and x * 1, and that would make the corpus easier than trained weights.
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import timm
import torch
import torchvision
import transformers as hf
from corpus import add_weight_noise, earlier_rows, run_inputs_text, write_index


@dataclass
class Spec:
    build: Callable[[], tuple[torch.nn.Module, tuple[torch.Tensor, ...]]]
    opset: int
    names: tuple[str, ...] = ("x",)
    dynamic: dict[str, dict[int, str]] = field(default_factory=dict)


class _First(torch.nn.Module):
    """The model's first tensor output (logits, last_hidden_state, out …)."""

    def __init__(self, model: torch.nn.Module, keys: tuple[str, ...] | None = None) -> None:
        super().__init__()
        self.model, self.keys = model.eval(), keys

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        out = self.model(**dict(zip(self.keys, xs, strict=True))) if self.keys else self.model(*xs)
        if isinstance(out, torch.Tensor):
            return out
        if hasattr(out, "logits"):
            return out.logits
        if hasattr(out, "last_hidden_state"):
            return out.last_hidden_state
        return out["out"] if isinstance(out, dict) and "out" in out else out[0]


class _DetHead(torch.nn.Module):
    """A torchvision detector's backbone + FPN + head outputs, without anchors/NMS/postprocess."""

    def __init__(self, det: torch.nn.Module) -> None:
        super().__init__()
        self.backbone, self.head = det.backbone, det.head

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        feats = self.backbone(x)
        feats = list(feats.values()) if isinstance(feats, dict) else [feats]
        out = self.head(feats)
        return tuple(out.values())


class CRNN(torch.nn.Module):
    """A CRNN text recogniser: small conv stack, height collapsed, BiLSTM/GRU, CTC logits."""

    def __init__(self, rnn: str = "lstm", classes: int = 37) -> None:
        super().__init__()
        c = torch.nn

        def block(i: int, o: int, pool: tuple[int, int]) -> list[c.Module]:
            return [c.Conv2d(i, o, 3, padding=1), c.BatchNorm2d(o), c.ReLU(), c.MaxPool2d(pool)]

        self.cnn = c.Sequential(
            *block(1, 32, (2, 2)),
            *block(32, 64, (2, 2)),
            *block(64, 128, (2, 1)),
            *block(128, 128, (2, 1)),
        )
        cls = c.LSTM if rnn == "lstm" else c.GRU
        self.rnn = cls(128 * 2, 96, num_layers=2, bidirectional=True, batch_first=False)
        self.fc = c.Linear(192, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.cnn(x)  # N, C, H, W
        n, ch, h, w = f.shape
        f = f.reshape(n, ch * h, w).permute(2, 0, 1)  # T, N, C
        y, _ = self.rnn(f)
        return self.fc(y).log_softmax(-1)


class SVTRLike(torch.nn.Module):
    """An SVTR-like recogniser: conv patch embed, transformer encoder, pooled height, CTC head."""

    def __init__(self, dim: int = 96, classes: int = 37) -> None:
        super().__init__()
        c = torch.nn
        self.embed = c.Sequential(
            c.Conv2d(3, dim // 2, 3, 2, 1),
            c.BatchNorm2d(dim // 2),
            c.GELU(),
            c.Conv2d(dim // 2, dim, 3, 2, 1),
            c.BatchNorm2d(dim),
            c.GELU(),
        )
        layer = c.TransformerEncoderLayer(
            dim, 4, dim * 2, 0.0, "gelu", batch_first=True, norm_first=True
        )
        self.encoder = c.TransformerEncoder(layer, 3, enable_nested_tensor=False)
        self.norm = c.LayerNorm(dim)
        self.fc = c.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.embed(x)  # N, D, H/4, W/4
        n, d, h, w = f.shape
        t = f.flatten(2).transpose(1, 2)  # N, HW, D
        t = self.encoder(t)
        t = t.reshape(n, h, w, d).mean(1)  # N, W, D
        return self.fc(self.norm(t)).softmax(-1)


def timm_spec(name: str, opset: int, size: int = 224, batch_dynamic: bool = False) -> Spec:
    return Spec(
        lambda: (
            timm.create_model(name, pretrained=False, num_classes=100),
            (torch.randn(1, 3, size, size),),
        ),
        opset,
        dynamic={"x": {0: "batch"}} if batch_dynamic else {},
    )


def image(module: torch.nn.Module, *shape: int) -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
    return _First(module), (torch.randn(*(shape or (1, 3, 224, 224))),)


def text(config: hf.PretrainedConfig, cls: Callable, mask: bool, seq: int = 32):
    config._attn_implementation = "eager"  # sdpa has no ONNX symbolic below opset 14
    keys = ("input_ids", "attention_mask") if mask else ("input_ids",)
    ids = torch.randint(0, 1000, (1, seq))
    xs = (ids, torch.ones(1, seq, dtype=torch.int64)) if mask else (ids,)
    return _First(cls(config), keys), xs


def specs() -> dict[str, Spec]:
    tv = torchvision.models
    seg = {"weights": None, "weights_backbone": None, "num_classes": 10}
    seq_dyn = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}}
    bert_cfg = dict(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=512,
        vocab_size=1000,
    )
    return {
        # classifiers
        "resnet18_op13_dyn": timm_spec("resnet18", 13, batch_dynamic=True),
        "mobilenetv2_100_op11": timm_spec("mobilenetv2_100", 11),
        "mobilenetv3_small_100_op17": timm_spec("mobilenetv3_small_100", 17),
        "efficientnet_b0_op13": timm_spec("efficientnet_b0", 13),
        "regnety_002_op11": timm_spec("regnety_002", 11),
        "ghostnet_100_op13": timm_spec("ghostnet_100", 13),
        "convnext_atto_op13": timm_spec("convnext_atto", 13),
        "convnext_atto_op17": timm_spec("convnext_atto", 17),
        "densenet121_op11": timm_spec("densenet121", 11),
        "tv_shufflenet_op11": Spec(lambda: image(tv.shufflenet_v2_x0_5()), 11),
        "tv_squeezenet_op13_dyn": Spec(
            lambda: image(tv.squeezenet1_1()), 13, dynamic={"x": {0: "batch"}}
        ),
        "tv_mobilenet_v3_large_op11": Spec(lambda: image(tv.mobilenet_v3_large()), 11),
        # vision transformers
        "vit_tiny_op13": timm_spec("vit_tiny_patch16_224", 13),
        "vit_tiny_op17_dyn": timm_spec("vit_tiny_patch16_224", 17, batch_dynamic=True),
        "deit_tiny_op11": timm_spec("deit_tiny_patch16_224", 11),
        "swin_tiny_op13": timm_spec("swin_tiny_patch4_window7_224", 13),
        "mobilevit_xxs_op13": timm_spec("mobilevit_xxs", 13, 256),
        "levit_128s_op11": timm_spec("levit_128s", 11),
        "efficientformer_l1_op13": timm_spec("efficientformer_l1", 13),
        # detection / segmentation
        "tv_ssdlite_head_op13": Spec(
            lambda: (
                _DetHead(
                    tv.detection.ssdlite320_mobilenet_v3_large(
                        weights=None, weights_backbone=None, num_classes=10
                    )
                ),
                (torch.randn(1, 3, 320, 320),),
            ),
            13,
        ),
        "tv_retinanet_head_op11": Spec(
            lambda: (
                _DetHead(
                    tv.detection.retinanet_resnet50_fpn(
                        weights=None, weights_backbone=None, num_classes=10
                    )
                ),
                (torch.randn(1, 3, 256, 256),),
            ),
            11,
        ),
        "tv_fcos_head_op13": Spec(
            lambda: (
                _DetHead(
                    tv.detection.fcos_resnet50_fpn(
                        weights=None, weights_backbone=None, num_classes=10
                    )
                ),
                (torch.randn(1, 3, 256, 256),),
            ),
            13,
        ),
        "tv_deeplabv3_mnv3_op11": Spec(
            lambda: image(tv.segmentation.deeplabv3_mobilenet_v3_large(**seg)), 11
        ),
        "tv_lraspp_mnv3_op17": Spec(
            lambda: image(tv.segmentation.lraspp_mobilenet_v3_large(**seg)), 17
        ),
        # OCR-like
        "crnn_lstm_op11": Spec(lambda: (CRNN("lstm"), (torch.randn(1, 1, 32, 128),)), 11),
        "crnn_gru_op13_dynw": Spec(
            lambda: (CRNN("gru"), (torch.randn(1, 1, 32, 128),)), 13, dynamic={"x": {3: "width"}}
        ),
        "svtr_like_op17": Spec(lambda: (SVTRLike(), (torch.randn(1, 3, 32, 128),)), 17),
        "svtr_like_op14_dynw": Spec(
            lambda: (SVTRLike(), (torch.randn(1, 3, 32, 128),)), 14, dynamic={"x": {3: "width"}}
        ),
        # HF text / audio transformers
        "hf_bert_op13_dyn": Spec(
            lambda: text(hf.BertConfig(**bert_cfg), hf.BertModel, True),
            13,
            ("input_ids", "attention_mask"),
            seq_dyn,
        ),
        "hf_distilbert_op11": Spec(
            lambda: text(
                hf.DistilBertConfig(
                    dim=128, n_layers=2, n_heads=2, hidden_dim=256, vocab_size=1000
                ),
                hf.DistilBertModel,
                True,
            ),
            11,
            ("input_ids", "attention_mask"),
        ),
        "hf_roberta_op17": Spec(
            lambda: text(hf.RobertaConfig(**bert_cfg), hf.RobertaModel, False), 17, ("input_ids",)
        ),
        "hf_gpt2_op13_dyn": Spec(
            lambda: text(
                hf.GPT2Config(n_embd=128, n_layer=2, n_head=2, vocab_size=1000), hf.GPT2Model, False
            ),
            13,
            ("input_ids",),
            {"input_ids": {0: "batch", 1: "seq"}},
        ),
        "hf_whisper_encoder_op17": Spec(
            lambda: (
                _First(
                    hf.WhisperModel(
                        hf.WhisperConfig(
                            d_model=64,
                            encoder_layers=2,
                            encoder_attention_heads=2,
                            decoder_layers=1,
                            decoder_attention_heads=2,
                            encoder_ffn_dim=128,
                            decoder_ffn_dim=128,
                            max_source_positions=750,
                            attn_implementation="eager",
                        )
                    ).encoder
                ),
                (torch.randn(1, 80, 1500),),
            ),
            17,
        ),
        "hf_wav2vec2_op13": Spec(
            lambda: (
                _First(
                    hf.Wav2Vec2Model(
                        hf.Wav2Vec2Config(
                            hidden_size=64,
                            num_hidden_layers=2,
                            num_attention_heads=2,
                            intermediate_size=128,
                            conv_dim=(32,) * 7,
                            attn_implementation="eager",
                        )
                    )
                ),
                (torch.randn(1, 16000),),
            ),
            13,
        ),
    }


RUN_SHAPES = {
    "crnn_gru_op13_dynw": {"x": [1, 1, 32, 160]},
    "svtr_like_op14_dynw": {"x": [1, 3, 32, 160]},
}
"""Run shapes differing from the export example (a dynamic axis run at another size)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", nargs="*", help="export only these names")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    # scaled_dot_product_attention has no TorchScript symbolic below opset 14, and the fused
    # nn.TransformerEncoderLayer fast path none at all: export the unfused attention, as
    # users of the legacy exporter do.
    timm.layers.set_fused_attn(False)
    torch.backends.mha.set_fastpath_enabled(False)
    torch.manual_seed(0)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = earlier_rows(args.out)
    for name, spec in specs().items():
        if args.only and name not in args.only:
            continue
        try:
            module, xs = spec.build()
            module.eval()
            add_weight_noise(module)
            path = args.out / f"{name}.onnx"
            with torch.no_grad():
                torch.onnx.export(
                    module,
                    xs,
                    str(path),
                    dynamo=False,
                    opset_version=spec.opset,
                    input_names=list(spec.names),
                    dynamic_axes=spec.dynamic or None,
                    do_constant_folding=True,
                )
            run = RUN_SHAPES.get(
                name, {n: list(x.shape) for n, x in zip(spec.names, xs, strict=True)}
            )
            rows[path.name] = run_inputs_text(run)
            print(f"ok    {name}", flush=True)
        except Exception as exc:  # noqa: BLE001 - report and go on with the next model
            print(f"FAIL  {name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    write_index(args.out, rows)


if __name__ == "__main__":
    main()
