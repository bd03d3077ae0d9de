"""Operator replacement rules (category "replace"): each rewrites an op the MLA rejects into an
equivalent form it accepts. One module per family; importing this one registers them all."""

from surgery.rules import (  # noqa: F401
    replace_activation,
    replace_arith,
    replace_conv,
    replace_gelu,
    replace_linear,
    replace_pad,
    replace_pool,
    replace_reduce,
    replace_resize,
    replace_shuffle,
    replace_slicing,
)
