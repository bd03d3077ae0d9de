"""Export a corpus of Hugging Face transformers the way Hugging Face users export them, with
Optimum's ONNX exporter (`optimum.exporters.onnx.main_export`, as `optimum-cli export onnx`),
for `pipeline_sweep.py`.

Decoders with KV cache (past_key_values.* inputs, present.* outputs), encoder-decoder models
split into encoder / decoder / decoder_with_past files and the merged decoder (an `If` on
use_cache_branch), OCR transformers (TrOCR: ViT encoder + TrOCR decoder; Donut: DonutSwin +
MBart). No weights are downloaded: each model is built from a tiny config with random weights
plus a little noise (default init leaves biases 0 and norm scales 1, which remove-identity
rightly deletes), saved to a local folder and exported from there with an explicit task.

    python -m venv /tmp/opt_env
    /tmp/opt_env/bin/pip install torch==2.14.1 optimum-onnx==0.1.0 "transformers<4.58" onnxruntime
    /tmp/opt_env/bin/python bench/export_optimum_models.py --out /tmp/optimum_models
    python bench/pipeline_sweep.py --models /tmp/optimum_models --target mlsoc rk3588

Needs optimum-onnx 0.1.0 (optimum 2.1), which supports transformers below 4.58 only, and torch:
a separate venv, apart from the one of export_dynamo_models.py.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import onnx
import torch
import transformers as hf
from corpus import add_weight_noise, earlier_rows, run_inputs_text, write_index
from optimum.exporters.onnx import main_export

V = 256  # vocabulary: small, so embeddings stay small
TOK = {"pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2}

# The run shapes: optimum's symbolic dims by name.
DIMS = {
    "batch_size": 1,
    "sequence_length": 16,
    "decoder_sequence_length": 16,
    "past_sequence_length": 8,
    "past_decoder_sequence_length": 8,
    "encoder_sequence_length": 16,
    "encoder_sequence_length_out": 16,
    "num_channels": 3,
    "height": 64,
    "width": 64,
    "feature_size": 16,
    "encoder_sequence_length / 2": 32,
}
WITH_PAST_SEQ = 1  # decoder_with_past / KV decoders are run one token at a time


def _vit() -> hf.ViTConfig:
    return hf.ViTConfig(
        image_size=64,
        patch_size=16,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
    )


def models() -> dict[str, tuple[Callable[[], torch.nn.Module], str, dict[str, int]]]:
    """name -> (build, optimum task, run dims overriding DIMS)."""
    dec = dict(vocab_size=V, **TOK)
    return {
        "gpt2": (
            lambda: hf.GPT2LMHeadModel(
                hf.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=64, **dec)
            ),
            "text-generation-with-past",
            {},
        ),
        "gpt2_nopast": (
            lambda: hf.GPT2LMHeadModel(
                hf.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=64, **dec)
            ),
            "text-generation",
            {},
        ),
        "llama": (
            lambda: hf.LlamaForCausalLM(
                hf.LlamaConfig(
                    hidden_size=64,
                    intermediate_size=128,
                    num_hidden_layers=2,
                    num_attention_heads=4,
                    num_key_value_heads=2,
                    max_position_embeddings=64,
                    **dec,
                )
            ),
            "text-generation-with-past",
            {},
        ),
        "qwen2": (
            lambda: hf.Qwen2ForCausalLM(
                hf.Qwen2Config(
                    hidden_size=64,
                    intermediate_size=128,
                    num_hidden_layers=2,
                    num_attention_heads=4,
                    num_key_value_heads=2,
                    max_position_embeddings=64,
                    **dec,
                )
            ),
            "text-generation-with-past",
            {},
        ),
        "bert": (
            lambda: hf.BertModel(
                hf.BertConfig(
                    vocab_size=V,
                    hidden_size=64,
                    num_hidden_layers=2,
                    num_attention_heads=4,
                    intermediate_size=128,
                    max_position_embeddings=64,
                )
            ),
            "feature-extraction",
            {},
        ),
        "t5": (
            lambda: hf.T5ForConditionalGeneration(
                hf.T5Config(
                    vocab_size=V,
                    d_model=64,
                    d_kv=16,
                    d_ff=128,
                    num_layers=2,
                    num_heads=4,
                    decoder_start_token_id=0,
                    pad_token_id=0,
                    eos_token_id=1,
                )
            ),
            "text2text-generation-with-past",
            {},
        ),
        "bart": (
            lambda: hf.BartForConditionalGeneration(
                hf.BartConfig(
                    d_model=64,
                    encoder_layers=2,
                    decoder_layers=2,
                    encoder_attention_heads=4,
                    decoder_attention_heads=4,
                    encoder_ffn_dim=128,
                    decoder_ffn_dim=128,
                    max_position_embeddings=64,
                    decoder_start_token_id=2,
                    **dec,
                )
            ),
            "text2text-generation-with-past",
            {},
        ),
        "whisper": (
            lambda: hf.WhisperForConditionalGeneration(
                hf.WhisperConfig(
                    vocab_size=V,
                    d_model=64,
                    encoder_layers=2,
                    decoder_layers=2,
                    encoder_attention_heads=4,
                    decoder_attention_heads=4,
                    encoder_ffn_dim=128,
                    decoder_ffn_dim=128,
                    num_mel_bins=16,
                    max_source_positions=32,
                    max_target_positions=64,
                    decoder_start_token_id=3,
                    pad_token_id=1,
                    bos_token_id=0,
                    eos_token_id=2,
                    suppress_tokens=[],
                    begin_suppress_tokens=[],
                )
            ),
            "automatic-speech-recognition-with-past",
            {"encoder_sequence_length": 32},
        ),
        "trocr": (
            lambda: hf.VisionEncoderDecoderModel(
                encoder=hf.ViTModel(_vit(), add_pooling_layer=False),
                decoder=hf.TrOCRForCausalLM(
                    hf.TrOCRConfig(
                        d_model=64,
                        decoder_layers=2,
                        decoder_attention_heads=4,
                        decoder_ffn_dim=128,
                        max_position_embeddings=64,
                        decoder_start_token_id=2,
                        **dec,
                    )
                ),
            ),
            "image-to-text-with-past",
            {"encoder_sequence_length": 17},  # 4x4 patches + CLS
        ),
        "donut": (
            lambda: hf.VisionEncoderDecoderModel(
                encoder=hf.DonutSwinModel(
                    hf.DonutSwinConfig(
                        image_size=[64, 64],
                        patch_size=4,
                        embed_dim=32,
                        depths=[1, 1],
                        num_heads=[2, 4],
                        window_size=4,
                        mlp_ratio=2.0,
                    )
                ),
                decoder=hf.MBartForCausalLM(
                    hf.MBartConfig(
                        d_model=64,
                        decoder_layers=2,
                        decoder_attention_heads=4,
                        encoder_attention_heads=4,  # optimum's dummy past reads this one
                        decoder_ffn_dim=128,
                        max_position_embeddings=64,
                        decoder_start_token_id=2,
                        is_decoder=True,
                        add_cross_attention=True,
                        **dec,
                    )
                ),
            ),
            "image-to-text-with-past",
            {"encoder_sequence_length": 64},  # 64/4/2 = 8x8 tokens after one merge
        ),
    }


EXPORT_SHAPES = {"whisper": {"nb_max_frames": 64}}
"""Dummy-input sizes for the exporter where its defaults do not fit a tiny config."""

KEEP = {
    "model.onnx": "",
    "encoder_model.onnx": "_encoder",
    "decoder_model.onnx": "_decoder",
    "decoder_with_past_model.onnx": "_decoder_with_past",
    "decoder_model_merged.onnx": "_decoder_merged",
}


def _dim(d: onnx.TensorShapeProto.Dimension, dims: dict[str, int], with_past: bool) -> int:
    if d.HasField("dim_value"):
        return d.dim_value
    name = d.dim_param
    if with_past and name in ("sequence_length", "decoder_sequence_length"):
        return WITH_PAST_SEQ
    if name in dims:
        return dims[name]
    try:  # "past_sequence_length + sequence_length" and the like
        return int(
            eval(name, {}, {**dims, **({"sequence_length": WITH_PAST_SEQ} if with_past else {})})
        )  # noqa: S307
    except Exception as exc:  # noqa: BLE001
        raise ValueError(f"no run size for dim {name!r}") from exc


def run_inputs(path: Path, dims: dict[str, int]) -> str:
    proto = onnx.load(str(path), load_external_data=False)
    names = [i.name for i in proto.graph.input]
    with_past = (
        any(n.startswith("past_key_values") for n in names) and "use_cache_branch" not in names
    )
    parts: dict[str, list[int]] = {}
    for vi in proto.graph.input:
        shape = [_dim(d, dims, with_past) for d in vi.type.tensor_type.shape.dim]
        if vi.name == "use_cache_branch":
            shape = [1]
        parts[vi.name] = shape
    return run_inputs_text(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "optimum_hf")
    parser.add_argument("--only", nargs="*", help="export only these names")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = earlier_rows(args.out)
    for name, (build, task, dims_over) in models().items():
        if args.only and name not in args.only:
            continue
        try:
            torch.manual_seed(0)
            model = build().eval()
            add_weight_noise(model)
            src = args.work / name
            shutil.rmtree(src, ignore_errors=True)
            model.save_pretrained(src)
            dst = args.work / f"{name}_onnx"
            shutil.rmtree(dst, ignore_errors=True)
            main_export(
                str(src),
                dst,
                task=task,
                do_validation=False,
                library_name="transformers",
                **EXPORT_SHAPES.get(name, {}),
            )
            dims = {**DIMS, **dims_over}
            for file, suffix in KEEP.items():
                if (dst / file).exists():
                    out = args.out / f"{name}{suffix}.onnx"
                    onnx.save(onnx.load(str(dst / file)), str(out))  # inline any external data
                    rows[out.name] = run_inputs(out, dims)
                    print(f"ok    {out.name}: {rows[out.name]}", flush=True)
        except Exception as exc:  # noqa: BLE001 - report and go on with the next model
            print(f"FAIL  {name}: {type(exc).__name__}: {str(exc)[:400]}", flush=True)
    write_index(args.out, rows)


if __name__ == "__main__":
    main()
