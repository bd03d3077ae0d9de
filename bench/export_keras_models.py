"""Export a corpus of Keras models with tf2onnx, for `pipeline_sweep.py`.

tf2onnx's graphs differ from torch's: NHWC models whose Transposes its optimizer mostly
removes (MobileNetV2 keeps one, at the input), Keras 3's LSTM as an ONNX Loop whose body reads
the sequence from the outer graph (plus ReverseSequence for Bidirectional; Keras 2 writes the
LSTM op), SE blocks as Reshape/Squeeze pairs, AveragePool without padded counts. This writes
keras.applications models and hand-built CRNN, U-Net, ViT, YOLO-style and depthwise/separable
models with random weights (no downloads) plus a little noise, at opsets 13 and 17, each
checked against Keras on ONNX Runtime, and an INDEX.tsv with the input shapes:

    python -m venv /tmp/tf_env && /tmp/tf_env/bin/pip install tensorflow-cpu tf2onnx onnxruntime
    /tmp/tf_env/bin/python bench/export_keras_models.py --out /tmp/keras_models [--only NAME ...]
    python bench/pipeline_sweep.py --models /tmp/keras_models --target mlsoc rk3588

Measured with tensorflow-cpu 2.21, keras 3.15, tf2onnx 1.17 (KERAS2=1 with tf-keras exports
the Keras 2 graphs, files suffixed _k2). ConvNeXt and the ViT do not export as they are (TF's
exact GELU uses Erfc, which tf2onnx does not map; Keras 3 wraps grouped convolutions in an XLA
function tf2onnx leaves as StatefulPartitionedCall): those are retried with
`tf2onnx_friendly`, which changes only how they are traced, not what they compute.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import traceback
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import tensorflow as tf  # noqa: E402

KERAS2 = os.environ.get("KERAS2") == "1"
if KERAS2:  # tf-keras (Keras 2), the tf.keras of TF <= 2.15: files get a _k2 suffix
    import tf_keras as keras  # noqa: E402
else:
    import keras  # noqa: E402
import tf2onnx  # noqa: E402
from corpus import earlier_rows, run_inputs_text, write_index  # noqa: E402

L = keras.layers
SUFFIX = "_k2" if KERAS2 else ""
RNG = np.random.default_rng(0)


def add_noise(model: keras.Model, scale: float = 0.02) -> None:
    """Noise on every weight so biases are not 0, BN gamma not 1, beta/mean not 0."""
    for layer in model.layers:
        ws = layer.get_weights()
        if not ws:
            continue
        names = [getattr(w, "path", w.name) for w in layer.weights]
        new = []
        for name, w in zip(names, ws, strict=True):
            if not np.issubdtype(w.dtype, np.floating):
                new.append(w)
                continue
            noise = RNG.normal(0.0, scale, size=w.shape).astype(w.dtype)
            if "variance" in name:
                new.append(np.abs(w + noise) + 1e-3)
            else:
                new.append(w + noise)
        layer.set_weights(new)


# ---------------------------------------------------------------- applications


def app(fn, size=224, **kw):
    def build():
        return fn(weights=None, input_shape=(size, size, 3), **kw), {"input_1": (1, size, size, 3)}

    return build


# ---------------------------------------------------------------- hand-built


def crnn():
    x = inp = keras.Input((32, 128, 1), batch_size=1, name="image")
    for ch, pool in ((32, (2, 2)), (64, (2, 2)), (128, (2, 1))):
        x = L.Conv2D(ch, 3, padding="same")(x)
        x = L.BatchNormalization()(x)
        x = L.ReLU()(x)
        x = L.MaxPooling2D(pool)(x)
    # (1, 4, 32, 128) -> width-major sequence (1, 32, 4*128)
    x = L.Permute((2, 1, 3))(x)
    x = L.Reshape((32, 4 * 128))(x)
    x = L.Dense(128, activation="relu")(x)
    x = L.Bidirectional(L.LSTM(64, return_sequences=True))(x)
    x = L.Dense(37, activation="softmax")(x)
    return keras.Model(inp, x, name="crnn"), {"image": (1, 32, 128, 1)}


def unet():
    x = inp = keras.Input((128, 128, 3), batch_size=1, name="image")
    skips = []
    for ch in (16, 32, 64):
        x = L.Conv2D(ch, 3, padding="same", activation="relu")(x)
        x = L.BatchNormalization()(x)
        x = L.Conv2D(ch, 3, padding="same", activation="relu")(x)
        skips.append(x)
        x = L.MaxPooling2D()(x)
    x = L.Conv2D(128, 3, padding="same", activation="relu")(x)
    for ch, skip in zip((64, 32, 16), reversed(skips), strict=True):
        x = L.Conv2DTranspose(ch, 2, strides=2, padding="same")(x)
        x = L.Concatenate()([x, skip])
        x = L.Conv2D(ch, 3, padding="same", activation="relu")(x)
        x = L.BatchNormalization()(x)
    x = L.Conv2D(2, 1, activation="sigmoid")(x)
    return keras.Model(inp, x, name="unet"), {"image": (1, 128, 128, 3)}


class PosEmbed(L.Layer):
    def build(self, shape):
        self.pos = self.add_weight(shape=(1, shape[1], shape[2]), initializer="random_normal")

    def call(self, x):
        return x + self.pos


def tiny_vit():
    dim, heads = 64, 4
    x = inp = keras.Input((64, 64, 3), batch_size=1, name="image")
    x = L.Conv2D(dim, 8, strides=8)(x)  # (1, 8, 8, 64)
    x = L.Reshape((64, dim))(x)
    x = PosEmbed()(x)
    for _ in range(2):
        h = L.LayerNormalization(epsilon=1e-6)(x)
        h = L.MultiHeadAttention(heads, key_dim=dim // heads)(h, h)
        x = L.Add()([x, h])
        h = L.LayerNormalization(epsilon=1e-6)(x)
        h = L.Dense(dim * 2, activation="gelu")(h)
        h = L.Dense(dim)(h)
        x = L.Add()([x, h])
    x = L.LayerNormalization(epsilon=1e-6)(x)
    x = L.GlobalAveragePooling1D()(x)
    x = L.Dense(10)(x)
    return keras.Model(inp, x, name="tiny_vit"), {"image": (1, 64, 64, 3)}


def yolo_head():
    def cbl(x, ch, s=1):
        x = L.Conv2D(ch, 3, strides=s, padding="same", use_bias=False)(x)
        x = L.BatchNormalization()(x)
        return L.LeakyReLU(0.1)(x)

    x = inp = keras.Input((256, 256, 3), batch_size=1, name="images")
    x = cbl(x, 16, 2)
    x = cbl(x, 32, 2)
    x = cbl(x, 64, 2)
    p3 = x = cbl(x, 64)  # 32x32
    p4 = x = cbl(x, 128, 2)  # 16x16
    p5 = cbl(x, 256, 2)  # 8x8
    outs = []
    for p in (p3, p4, p5):
        h, w = p.shape[1], p.shape[2]
        y = L.Conv2D(3 * 85, 1)(p)
        y = L.Reshape((h * w * 3, 85))(y)
        y = L.Activation("sigmoid")(y)
        outs.append(y)
    y = L.Concatenate(axis=1)(outs)
    return keras.Model(inp, y, name="yolo_head"), {"images": (1, 256, 256, 3)}


def mixed_ops():
    x = inp = keras.Input((96, 96, 3), batch_size=1, name="image")
    x = L.Conv2D(16, 3, strides=2, padding="same", activation="relu")(x)
    x = L.DepthwiseConv2D(3, padding="same")(x)
    x = L.BatchNormalization()(x)
    x = L.ReLU(6.0)(x)
    x = L.SeparableConv2D(32, 3, strides=2, padding="same", activation="relu")(x)
    skip = x
    x = L.SeparableConv2D(64, 3, strides=2, padding="same", activation="relu")(x)
    x = L.UpSampling2D(2, interpolation="bilinear")(x)
    x = L.Concatenate()([x, skip])
    x = L.DepthwiseConv2D(3, strides=2, padding="same", depth_multiplier=2)(x)
    x = L.Activation("swish")(x)
    x = L.GlobalAveragePooling2D()(x)
    x = L.Dense(32, activation="relu")(x)
    x = L.Dense(10, activation="softmax")(x)
    return keras.Model(inp, x, name="mixed_ops"), {"image": (1, 96, 96, 3)}


A = keras.applications
MODELS = {
    "mobilenetv2": app(A.MobileNetV2),
    "mobilenetv3small": app(A.MobileNetV3Small),
    "efficientnetb0": app(A.EfficientNetB0),
    "resnet50": app(A.ResNet50),
    "densenet121": app(A.DenseNet121),
    "nasnetmobile": app(A.NASNetMobile),
    "convnexttiny": app(A.ConvNeXtTiny),
    "xception": app(A.Xception, size=299),
    "crnn": crnn,
    "unet": unet,
    "tiny_vit": tiny_vit,
    "yolo_head": yolo_head,
    "mixed_ops": mixed_ops,
}


@contextlib.contextmanager
def tf2onnx_friendly():
    """Workarounds used only when the stock export fails, only while tracing for tf2onnx:
    exact GELU as erf (TF 2.21's tf.nn.gelu uses Erfc, which tf2onnx does not map), and
    grouped Conv2D traced as a plain tf.nn.convolution (Keras 3 wraps it in an XLA
    tf.function on CPU, which tf2onnx leaves as StatefulPartitionedCall)."""
    import keras.src.backend.tensorflow.nn as knn

    old_gelu, old_conv = tf.nn.gelu, knn.conv

    def gelu(x, approximate=False, name=None):
        if approximate:
            return old_gelu(x, approximate=True)
        return 0.5 * x * (1.0 + tf.math.erf(x / math.sqrt(2.0)))

    def conv(inputs, kernel, strides=1, padding="valid", data_format=None, dilation_rate=1):
        fmt = knn._convert_data_format(data_format, len(inputs.shape))
        return tf.nn.convolution(
            inputs, kernel, strides, padding.upper(), data_format=fmt, dilations=dilation_rate
        )

    tf.nn.gelu, knn.conv = gelu, conv
    try:
        yield
    finally:
        tf.nn.gelu, knn.conv = old_gelu, old_conv


def convert(model, spec, opset, path):
    try:
        proto, _ = tf2onnx.convert.from_keras(
            model, input_signature=spec, opset=opset, output_path=str(path)
        )
        onnx.checker.check_model(proto)
        return proto
    except Exception as exc:  # noqa: BLE001
        print(
            f"STOCK-FAIL {path.name}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            " -> retrying with tf2onnx_friendly()",
            flush=True,
        )
    with tf2onnx_friendly():
        proto, _ = tf2onnx.convert.from_keras(
            model, input_signature=spec, opset=opset, output_path=str(path)
        )
    onnx.checker.check_model(proto)
    return proto


def export(name: str, opset: int, out: Path, cache: dict) -> tuple[str, str]:
    if name not in cache:
        keras.utils.set_random_seed(0)
        model, shapes = MODELS[name]()
        add_noise(model)
        cache[name] = (model, shapes)
    model, shapes = cache[name]
    spec = tuple(tf.TensorSpec(s, tf.float32, name=n) for n, s in shapes.items())
    path = out / f"{name}{SUFFIX}_op{opset}.onnx"
    proto = convert(model, spec, opset, path)
    names = [i.name for i in proto.graph.input]
    assert len(names) == len(shapes), names
    # numeric check against keras on onnxruntime
    try:
        import onnxruntime as ort

        feeds = {
            n: RNG.standard_normal(s).astype(np.float32)
            for n, s in zip(names, shapes.values(), strict=True)
        }
        ref = model(*[tf.constant(v) for v in feeds.values()], training=False)
        ref = np.asarray(ref)
        got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)[
            0
        ]
        diff = float(np.max(np.abs(ref - got)))
    except Exception as exc:  # noqa: BLE001
        diff = f"ort check failed: {type(exc).__name__}: {exc}"
    ops = sorted({n.op_type for n in proto.graph.node})
    print(f"OK {path.name} inputs={names} maxdiff={diff} ops={ops}", flush=True)
    return path.name, run_inputs_text(dict(zip(names, shapes.values(), strict=True)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", nargs="*")
    parser.add_argument("--opsets", nargs="*", type=int, default=[13, 17])
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = earlier_rows(args.out)
    failed = []
    for name in args.only or MODELS:
        cache: dict = {}
        for opset in args.opsets:
            try:
                file, shapes = export(name, opset, args.out, cache)
                rows[file] = shapes
            except Exception as exc:  # noqa: BLE001
                msg = f"{name} op{opset}: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
                print("FAIL", msg, flush=True)
                traceback.print_exc()
                failed.append(msg)
        keras.backend.clear_session()
        write_index(args.out, rows)
    print("failed:", *failed, sep="\n  ")


if __name__ == "__main__":
    main()
