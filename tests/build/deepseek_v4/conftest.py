"""Session fixtures for DeepSeek-V4: tiny checkpoints, transformers' logits, and built graphs (cached)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.build.deepseek_v4.helpers import (
    MAX_SEQ,
    V4Runner,
    make_model,
    reference,
    save_model,
    token_ids,
    write_official,
)


class V4Fixtures:
    """Builds each (checkpoint, flavor, scheme) graph once per session."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._models: dict[str, Any] = {}
        self._refs: dict[str, Any] = {}
        self._graphs: dict[tuple, V4Runner] = {}

    def model(self, schedule: str) -> Any:
        if schedule not in self._models:
            self._models[schedule] = make_model(schedule)
        return self._models[schedule]

    def hf_dir(self, schedule: str) -> Path:
        d = self.root / f"hf_{schedule}"
        if not d.exists():
            save_model(self.model(schedule), d)
        return d

    def official_dir(self, schedule: str, fp8: str | None, mxfp4: bool) -> Path:
        d = self.root / f"official_{schedule}_{fp8}_{int(mxfp4)}"
        if not d.exists():
            write_official(self.model(schedule), self.hf_dir(schedule), d, fp8=fp8, mxfp4=mxfp4)
            for f in ("tokenizer.json", "tokenizer_config.json"):
                (d / f).write_bytes((self.hf_dir(schedule) / f).read_bytes())
        return d

    def ref(self, schedule: str) -> tuple[Any, Any, float]:
        """(ids, transformers logits [T, V], smallest relative gap at an indexer top-k cut)."""
        if schedule not in self._refs:
            ids = token_ids()
            logits, gap = reference(self.model(schedule), ids)
            self._refs[schedule] = (ids, logits, gap)
        return self._refs[schedule]

    def runner(self, ckpt_dir: Path, flavor: str, scheme: str = "fp32", group_size: int = 64,
               trt_dtype: str = "fp16", kv_dtype: str = "fp16", max_seq: int = MAX_SEQ) -> V4Runner:
        key = (str(ckpt_dir), flavor, scheme, group_size, trt_dtype, kv_dtype, max_seq)
        if key not in self._graphs:
            from lineside.build.checkpoint import open_checkpoint
            from lineside.build.models import deepseek_v4 as v4
            from lineside.build.quant.spec import QuantSpec

            out = self.root / "graphs" / f"{ckpt_dir.name}_{flavor}_{scheme}_{group_size}_{trt_dtype}_{kv_dtype}_{max_seq}" / "model.onnx"
            ck = open_checkpoint(ckpt_dir)
            try:
                spec = QuantSpec(scheme=scheme, group_size=group_size, accuracy_level=0, trt_dtype=trt_dtype,
                                 kv_dtype=kv_dtype)
                entry = v4.emit_graph(ck.hf_config, ck, spec, flavor, out, max_seq)
            finally:
                ck.close()
            self._graphs[key] = V4Runner(out, entry, max_seq)
            self._graphs[key].sess._model_path = str(out)
        return self._graphs[key]


@pytest.fixture(scope="session")
def v4(tmp_path_factory: pytest.TempPathFactory) -> V4Fixtures:
    pytest.importorskip("transformers.models.deepseek_v4")
    return V4Fixtures(tmp_path_factory.mktemp("v4"))
