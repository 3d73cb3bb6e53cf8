"""The optional compiled writer (native/uring_writer.c -> ckptrun._uring); everything else is in
pyproject.toml. `optional=True`: without liburing's headers or a C compiler the install goes on
and the engine uses its pure-Python writer (ckptrun/storage/iowriter.py)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("ckptrun._uring", ["native/uring_writer.c"], libraries=["uring"], optional=True,
                             extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter",
                                                 "-Wno-missing-field-initializers"])])
