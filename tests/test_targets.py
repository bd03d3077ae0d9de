"""Target profiles: loading, validation, inheritance and per-op explanations."""

from __future__ import annotations

import pytest

from surgery.errors import TargetError
from surgery.targets import available_targets, load_target


def test_three_profiles_ship():
    assert {"mlsoc", "modalix", "rk3588"} <= set(available_targets())


def test_modalix_extends_mlsoc_and_adds_bf16_ops():
    mlsoc, modalix = load_target("mlsoc"), load_target("modalix")
    assert not mlsoc.supports("Gather", "MLA")
    assert modalix.supports("Gather", "MLA")
    assert modalix.supports("Conv", "MLA")
    assert modalix.profile.processors["MLA"].precisions == ["int8", "bf16"]


def test_rk3588_has_no_cvu():
    rk = load_target("rk3588")
    assert "CVU" not in rk.profile.processors
    assert not rk.supports("Einsum", "MLA")


def test_unknown_target_lists_available_ones():
    with pytest.raises(TargetError, match="mlsoc"):
        load_target("no-such-target")


def test_profile_with_unknown_check_is_rejected(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "name: bad\ntitle: Bad\nprocessors:\n  MLA: {description: x}\n"
        "ops:\n  Conv: {MLA: {constraints: [{check: no_such_check}]}}\n"
    )
    with pytest.raises(TargetError, match="unknown check 'no_such_check'"):
        load_target(str(bad))


def test_profile_constraint_missing_parameter_is_rejected(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "name: bad\ntitle: Bad\nprocessors:\n  MLA: {description: x}\n"
        "ops:\n  Conv: {MLA: {constraints: [{check: rank}]}}\n"
    )
    with pytest.raises(TargetError, match="needs parameter.*ranks"):
        load_target(str(bad))


def test_explain_fills_the_documented_rule_with_parameters():
    info = load_target("mlsoc").explain("Pow")
    mla = next(p for p in info["placements"] if p["processor"] == "MLA")
    rules = [c["rule"] for c in mla["constraints"]]
    assert "Input 1 must be a constant scalar in {0.5, -0.5, 2, 3}." in rules
    assert "Data tensors must be 4-D." in rules


def test_explain_op_not_in_table_falls_back_to_apu():
    info = load_target("mlsoc").explain("NonMaxSuppression")
    assert not info["on_mla"] and info["placements"][-1]["processor"] == "APU"


def test_explain_names_a_dynamic_quantization_op_as_such():
    note = load_target("rk3588").explain("MatMulInteger")["note"]
    assert "dynamic quantization" in note and "surgery quantize" in note
    assert "dynamic" not in load_target("rk3588").explain("NonMaxSuppression")["note"]


def test_explain_of_a_mis_cased_op_names_the_real_one():
    with pytest.raises(TargetError, match="unknown op 'resize'") as info:
        load_target("mlsoc").explain("resize")
    assert info.value.hint == "did you mean Resize?"


def test_explain_of_a_name_that_is_no_op_is_an_error():
    with pytest.raises(TargetError, match="not an ONNX operator"):
        load_target("mlsoc").explain("MakeItFast")


def test_a_missing_profile_file_is_named_as_a_missing_file(tmp_path):
    with pytest.raises(TargetError, match="no such file"):
        load_target(str(tmp_path / "custom.yaml"))
