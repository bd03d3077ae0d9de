"""`hybrid_outcome`: the one line on whether auto-hybrid reached its goal (CLI and MCP)."""

from __future__ import annotations

from compiler.quantize.advice import hybrid_outcome


def _hybrid(converged: bool, **settings) -> dict:
    return {
        "settings": {"precision": "int16", **settings},
        "converged": converged,
        "raised": [{"layer": "[Conv] a"}, {"layer": "[Conv] b"}],
        "remaining": [] if converged else ["[Conv] c"],
    }


def test_no_auto_hybrid_says_nothing():
    assert hybrid_outcome({}) is None


def test_a_target_missed_says_how_far_it_got():
    line = hybrid_outcome(
        _hybrid(False, target_sqnr_db=30, output_sqnr_db=27.05, worst_output="output0")
    )
    assert line.startswith("target 30 dB not reached: 27.05 dB (worst: output0)")
    assert "2 layer(s) raised to int16" in line


def test_a_target_reached_says_so():
    line = hybrid_outcome(_hybrid(True, target_sqnr_db=25, output_sqnr_db=31.2))
    assert line.startswith("target 25 dB reached: 31.20 dB")


def test_a_cosine_threshold_left_unmet_names_the_layers_under_it():
    line = hybrid_outcome(_hybrid(False, cos_thresh=0.98))
    assert (
        line
        == "1 layer(s) still under the auto-hybrid threshold after 2 layer(s) raised to int16: [Conv] c"
    )
