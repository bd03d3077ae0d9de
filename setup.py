"""Build the emulator's optional compiled kernels (everything else is in pyproject.toml).

The extension is optional: where no C compiler is available the install still succeeds and
the emulator runs its numpy code (compiler/native/__init__.py says which is in use).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "compiler.native._mla_kernels",
            ["compiler/native/mla_kernels.c"],
            depends=["compiler/native/mla_hot.h"],
            extra_compile_args=["-O3", "-ffp-contract=off", "-fno-strict-aliasing"],
            optional=True,
        )
    ]
)
