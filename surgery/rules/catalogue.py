"""Every rule module, in priority order for `surgery fix`: importing this registers them all.

The registry orders rules by this list (then by definition order within a module), so the
priority does not depend on which rule module some caller happened to import first.
"""

from __future__ import annotations

import importlib

MODULES = (
    "cleanup",
    "cleanup_norm",
    "cleanup_attention",
    "expand_functions",
    "expand_contrib",
    "replace_activation",
    "replace_arith",
    "replace_branches",
    "replace_broadcast_concat",
    "replace_conv_taps",
    "replace_conv",
    "replace_einsum",
    "replace_flatten",
    "replace_gelu",
    "replace_linear",
    "replace_lrn",
    "replace_pad",
    "replace_patch_conv",
    "replace_pool",
    "replace_recurrent",
    "replace_relative_gather",
    "replace_reduce",
    "replace_resize",
    "replace_shuffle",
    "replace_unfold",
    "replace_slicing",
    "structure",
    "inline_branch",
    "rank4",
    "rank4_heads",
    "rank4_hoist",
    "rank4_views",
)

for _module in MODULES:
    importlib.import_module(f"surgery.rules.{_module}")
