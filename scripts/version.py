#!/usr/bin/env python3
"""Prints infer's version, read from the INFER_VERSION_* macros in infer.hpp: the one place it is written.

meson.build calls this for the project's version, so the build, `infer --version` and the pkg-config file agree with
the header a reader drops into a project.
"""
import pathlib
import re

header = (pathlib.Path(__file__).resolve().parent.parent / "infer.hpp").read_text(encoding="utf-8")
parts = [re.search(rf"#define INFER_VERSION_{name} (\d+)", header).group(1) for name in ("MAJOR", "MINOR", "PATCH")]
print(".".join(parts))
