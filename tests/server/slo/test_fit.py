"""A fallback must fit beside the primary: the planner adds both up (runtime once), and serve refuses in one line
a fallback that would not fit when the primary alone does."""

from __future__ import annotations

import pytest

from lineside.errors import LinesideError
from lineside.jetson.planner import plan, plan_with_fallback
from lineside.server.slo.fallback import check_fits, planned_bytes


def test_planner_counts_primary_and_fallback_together():
    primary = plan("DeepSeek-R1-Distill-Qwen-7B", "orin-nano-8")
    fallback = plan("DeepSeek-R1-Distill-Qwen-1.5B", "orin-nano-8")
    pair = plan_with_fallback(primary, fallback)
    assert pair["total_bytes"] == primary.total_bytes + fallback.total_bytes - fallback.runtime_overhead_bytes
    assert primary.fits and fallback.fits and not pair["fits"]  # each fits alone, not both at once
    roomy = plan_with_fallback(plan("DeepSeek-R1-Distill-Qwen-14B", "orin-nx-16"),
                               plan("DeepSeek-R1-Distill-Qwen-1.5B", "orin-nx-16"))
    assert roomy["fits"] and roomy["headroom_bytes"] > 0


def test_serve_refuses_a_fallback_that_does_not_fit(tiny_bundle):
    need = planned_bytes(tiny_bundle, num_slots=4)
    assert need > 0 and planned_bytes(tiny_bundle, num_slots=8) > need  # the KV cache grows with the slots
    check_fits(tiny_bundle, tiny_bundle, num_slots=4, available=2 * need)  # both fit
    check_fits(tiny_bundle, tiny_bundle, num_slots=4, available=None)  # unknown memory: not refused
    check_fits(tiny_bundle, tiny_bundle, num_slots=4, available=need - 1)  # the primary alone does not fit: its error
    with pytest.raises(LinesideError) as e:
        check_fits(tiny_bundle, tiny_bundle, num_slots=4, available=need + need // 2)
    assert "does not fit beside tiny-llama" in str(e.value) and "\n" not in str(e.value)


def test_a_damaged_fallback_is_refused_naming_the_fallback(tiny_bundle, tmp_path):
    """Primary and fallback list the same file names: the error must say which bundle is damaged. A missing file
    is refused before the server starts (as the primary's is); a changed one when the fallback loads."""
    import asyncio
    import shutil

    from lineside.server.slo.fallback import check_fallback
    from lineside.server.slo.guard import SloGuard
    from lineside.server.slo.policy import SloPolicy

    missing, changed = tmp_path / "fb-missing", tmp_path / "fb-changed"
    for d in (missing, changed):
        shutil.copytree(tiny_bundle, d)
    (missing / "graphs" / "cpu" / "model.onnx.data").unlink()
    data = changed / "graphs" / "cpu" / "model.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(LinesideError) as e:
        check_fallback(tiny_bundle, missing)
    assert str(e.value).startswith(f"--fallback {missing}:") and "model.onnx.data" in str(e.value)
    check_fallback(tiny_bundle, changed)  # sizes only here: hashing waits for the load
    guard = SloGuard(SloPolicy(), fallback=changed, ticking=False)
    with pytest.raises(LinesideError) as e:
        asyncio.run(guard.start(object(), "tiny-llama"))
    assert str(e.value).startswith(f"--fallback {changed}:") and "sha256" in str(e.value)
    assert "\n" not in str(e.value)


def test_a_fallback_with_the_same_tokenizer_but_its_own_sampling_defaults_is_taken(tiny_dense, tmp_path):
    """generation_config.json sits in the bundle's tokenizer/ folder, but it is the model's sampling recommendation,
    not its tokenizer (requests are tokenized once and sampled with the primary's defaults): a smaller sibling with
    its own (Qwen2.5-0.5B-Instruct's repetition_penalty is not 7B's) was refused as 'its tokenizer differs'."""
    import hashlib
    import json
    import shutil

    from lineside.build.pipeline import BuildOptions, build_bundle
    from lineside.server.slo.fallback import check_fallback
    from tests.conftest import TINY_BUNDLE

    options = {k: v for k, v in TINY_BUNDLE.items() if k != "variant"}
    bundles = []
    for name, extra in (("primary", {}), ("fallback", {"temperature": 0.7, "repetition_penalty": 1.1})):
        ckpt = tmp_path / f"{name}-ckpt"
        shutil.copytree(tiny_dense(TINY_BUNDLE["variant"]), ckpt)
        gen = ckpt / "generation_config.json"
        gen.write_text(json.dumps({**json.loads(gen.read_text()), **extra}))
        bundles.append(build_bundle(ckpt, tmp_path / name, BuildOptions(**options)))
    primary, fallback = bundles
    check_fallback(primary, fallback)
    other = tmp_path / "other-tokenizer"  # a tokenizer that differs is still refused, in one line
    shutil.copytree(fallback, other)
    tok = other / "tokenizer" / "tokenizer.json"
    tok.write_text(tok.read_text().replace('"model"', '"model" ', 1))
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["files"]["tokenizer/tokenizer.json"] = {"size": tok.stat().st_size,
                                                     "sha256": hashlib.sha256(tok.read_bytes()).hexdigest()}
    (other / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(LinesideError, match="its tokenizer differs") as e:
        check_fallback(primary, other)
    assert "\n" not in str(e.value)
