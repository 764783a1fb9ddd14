"""Tiny real trt-flavor bundles built by the project's own pipeline (fp16 and W4A16)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def trt_bundle(tiny_dense, tmp_path_factory):
    from lineside.build.pipeline import BuildOptions, build_bundle
    from lineside.bundle import open_bundle

    cache = {}

    def get(quant: str = "fp16"):
        if quant not in cache:
            out = tmp_path_factory.mktemp(f"trt-{quant}") / "bundle"
            build_bundle(tiny_dense("llama-gqa"), out, BuildOptions(quant=quant, flavors=("trt",), max_seq_len=64,
                                                                      group_size=64, accuracy_level=0))
            cache[quant] = open_bundle(out)
        return cache[quant]

    return get
