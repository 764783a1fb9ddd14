"""DeepSeek-V4's MTP module (`--speculative mtp`) on a tiny V4 checkpoint carrying random mtp.0.* tensors named and
shaped as DeepSeek's release names them: the MTP graph's logits equal an independent numpy implementation of the
published formula (tests/build/deepseek_v4/mtp_reference.py), prefill and decode; the main graph's logits are
those of a build without MTP; the proposer's drafts equal the formula's recursion through partly rejected steps
and a slot move; greedy output with MTP equals plain decoding (generate and the engine, W4A16 at accuracy level
0); a bundle without an MTP module, an incomplete module, and a TensorRT target are each one line."""

from __future__ import annotations

import asyncio
import functools
import json

import numpy as np
import pytest

from lineside.errors import LinesideError
from lineside.runtime.speculative.config import SpecMethod, SpeculativeConfig
from tests.build.deepseek_v4.mtp_reference import NumpyMtp, with_mtp

MTP = SpeculativeConfig(SpecMethod.MTP, 3)


@pytest.fixture(scope="module")
def mtp_ckpt(v4, tmp_path_factory):
    return with_mtp(v4.hf_dir("a"), tmp_path_factory.mktemp("v4mtp") / "a-mtp")


def _build(ckpt, out, **kw):
    from lineside.build.pipeline import BuildOptions, build_bundle

    return build_bundle(ckpt, out, BuildOptions(flavors=("cpu",), max_seq_len=64, **kw))


@pytest.fixture(scope="module")
def bundles(v4, mtp_ckpt, tmp_path_factory):
    """fp32 with MTP, fp32 from the same checkpoint without mtp.* (transformers' save_pretrained), W4A16 level 0."""
    root = tmp_path_factory.mktemp("v4mtp-bundles")
    return {"fp32": _build(mtp_ckpt, root / "fp32", quant="fp32"),
            "plain": _build(v4.hf_dir("a"), root / "plain", quant="fp32"),
            "w4": _build(mtp_ckpt, root / "w4", quant="w4a16", group_size=32, accuracy_level=0)}


def _reference(ckpt) -> NumpyMtp:
    from safetensors.numpy import load_file

    w = load_file(str(ckpt / "model.safetensors"))
    cfg = json.loads((ckpt / "config.json").read_text())
    return NumpyMtp({k[len("mtp.0."):]: v for k, v in w.items() if k.startswith("mtp.0.")}, cfg,
                    w["model.embed_tokens.weight"], w["head.weight"])


class Graph:
    """One of a bundle's graphs on onnxruntime, its state kept here (zeros to start)."""

    def __init__(self, bundle, rel: str, states: list[dict]) -> None:
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.log_severity_level = 3
        self.sess = ort.InferenceSession(str(bundle / rel), so, providers=["CPUExecutionProvider"])
        self.states = states
        self.state = {s["input"]: np.zeros([1 if d == "batch" else 64 if d == "max_seq" else d for d in s["shape"]],
                                           np.float32) for s in states}

    def reset(self) -> Graph:
        self.state = {k: np.zeros_like(v) for k, v in self.state.items()}
        return self

    def run(self, names: list[str], **feeds) -> list[np.ndarray]:
        outs = self.sess.run(names + [s["output"] for s in self.states], {**feeds, **self.state})
        self.state = {s["input"]: v for s, v in zip(self.states, outs[len(names):], strict=True)}
        return outs[:len(names)]


@functools.cache
def _main(bundle) -> Graph:
    flavor = json.loads((bundle / "manifest.json").read_text())["flavors"]["cpu"]
    return Graph(bundle, flavor["graph"], flavor["state"])


def _hidden(bundle, tokens: list[int]) -> np.ndarray:
    """The main graph's last-layer streams h_0..h_{T-1} [T, N, D] from one fresh prefill."""
    ids = np.asarray(tokens, np.int64)[None]
    (h,) = _main(bundle).reset().run(["hidden_streams"], input_ids=ids, past_lengths=np.array([0]),
                                      logits_positions=np.arange(len(tokens))[None])
    return h[0]


def test_mtp_graph_equals_the_published_formula(bundles, mtp_ckpt):
    """Prefill of 19 positions, then 4 one-token steps, each against numpy over the whole prefix; the record
    names the shared weight file, and the main graph's logits are bit for bit those of a build without MTP."""
    b = bundles["fp32"]
    rec = json.loads((b / "manifest.json").read_text())["flavors"]["cpu"]["mtp_graph"]
    assert rec["graph"] == "graphs/cpu/mtp.onnx" and rec["hidden"] == "hidden_streams"
    assert [s["update"] for s in rec["state"]] == ["replace"] and 0 < rec["weight_fraction"] < 1
    import onnx

    mtp_model = onnx.load(str(b / rec["graph"]), load_external_data=False)
    names = {t.name for t in mtp_model.graph.initializer}
    assert {"embed_tokens.weight", "lm_head.weight"} <= names  # the main graph's, not copies
    assert {e.value for t in mtp_model.graph.initializer for e in t.external_data if e.key == "location"} == \
        {"model.onnx.data"}
    tokens = [1, *np.random.default_rng(3).integers(3, 120, 23).tolist()]
    ids = np.asarray(tokens, np.int64)[None]
    feeds = dict(input_ids=ids, past_lengths=np.array([0]), logits_positions=np.arange(len(tokens))[None])
    (with_mtp,) = _main(b).reset().run(["logits"], **feeds)
    (without,) = _main(bundles["plain"]).reset().run(["logits"], **feeds)
    np.testing.assert_array_equal(with_mtp, without)

    ref, h = _reference(mtp_ckpt), _hidden(b, tokens)
    g = Graph(b, rec["graph"], rec["state"])
    t0 = 19
    logits, streams = g.run(["logits", "mtp_hidden"], input_ids=ids[:, 1:t0 + 1], hidden_streams=h[None, :t0],
                            past_lengths=np.array([0]), logits_positions=np.arange(t0)[None])
    want, want_streams = ref.forward(np.array(tokens[1:t0 + 1]), h[:t0], np.arange(t0, dtype=np.float64))
    assert np.abs(logits[0] - want).max() <= 1e-4 * np.abs(want).max()
    np.testing.assert_allclose(streams[0], want_streams, rtol=1e-4, atol=1e-4)
    for p in range(t0, len(tokens) - 1):
        (lg,) = g.run(["logits"], input_ids=ids[:, p + 1:p + 2], hidden_streams=h[None, p:p + 1],
                      past_lengths=np.array([p]), logits_positions=np.zeros((1, 1), np.int64))
        full, _ = ref.forward(np.array(tokens[1:p + 2]), h[:p + 1], np.arange(p + 1, dtype=np.float64))
        assert np.abs(lg[0, 0] - full[-1]).max() <= 1e-4 * np.abs(full[-1]).max()


def test_mtp_from_fp8_and_mxfp4_release_tensors(v4, tmp_path):
    """DeepSeek's release format (official names, FP8 block-scaled linears, MXFP4 experts, for the main model and
    the MTP module alike): the MTP graph equals the formula on the dequantized tensors."""
    from lineside.build.checkpoint import open_checkpoint
    from lineside.build.models.deepseek_v4 import V4Source

    ckpt = with_mtp(v4.official_dir("a", "ue8m0", True), tmp_path / "official-mtp", quantized=True)
    b = _build(ckpt, tmp_path / "bundle", quant="fp32")
    src = V4Source(open_checkpoint(ckpt))
    own = {n[len("mtp.0."):]: src.read_source(n) for n in src.source_names()
           if n.startswith("mtp.0.") and not n.endswith(".scale")}
    assert own["e_proj.weight"].dtype == np.float32 and "ffn.experts.3.w2.weight" in own
    cfg = json.loads((ckpt / "config.json").read_text())
    ref = NumpyMtp(own, cfg, src.get("model.embed_tokens.weight"), src.get("lm_head.weight"))
    tokens = [1, *np.random.default_rng(4).integers(3, 120, 15).tolist()]
    h = _hidden(b, tokens)
    rec = json.loads((b / "manifest.json").read_text())["flavors"]["cpu"]["mtp_graph"]
    n = len(tokens) - 1
    (logits,) = Graph(b, rec["graph"], rec["state"]).run(
        ["logits"], input_ids=np.asarray(tokens[1:], np.int64)[None], hidden_streams=h[None, :n],
        past_lengths=np.array([0]), logits_positions=np.arange(n)[None])
    want, _ = ref.forward(np.array(tokens[1:]), h[:n], np.arange(n, dtype=np.float64))
    assert np.abs(logits[0] - want).max() <= 1e-4 * np.abs(want).max()


def test_mtp_proposer_drafts_follow_the_formula(bundles, mtp_ckpt):
    """Six proposals of 3 drafts: after each the target verifies, keeps 0, 1 or 2 of them (its whole state put
    back and the kept ones fed again, as the step runner does) and adds its own next token; half way the row
    moves to another slot. Every draft list is the formula's greedy recursion over the whole text."""
    from lineside.bundle import open_bundle
    from lineside.runtime.backend import StepBatch
    from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend
    from lineside.runtime.sampling import Sampler, SamplingParams
    from lineside.runtime.speculative.config import DraftRow
    from lineside.runtime.speculative.proposers import make_proposer

    b = open_bundle(bundles["fp32"])
    target = OnnxRuntimeBackend(b, num_slots=2, threads=2)
    proposer = make_proposer(MTP, b, target)
    ref, sampler, slot = _reference(mtp_ckpt), Sampler(SamplingParams()), 1
    tokens = [1, *np.random.default_rng(5).integers(3, 120, 11).tolist()]
    prompt_len = len(tokens)
    logits = target.forward(StepBatch.single(slot, tokens, 0))
    tokens.append(int(np.argmax(logits[0, -1])))
    for step in range(6):
        if step == 3:  # the scheduler moves a decoding row with copy_slot
            target.copy_slot(slot, 0, len(tokens) - 1)
            target.reset_slot(slot)
            slot = 0
        drafts = proposer.propose_rows([DraftRow(slot, list(tokens), 3, sampler, prompt_len)])[0].tokens
        assert drafts == ref.drafts(tokens, _hidden(bundles["fp32"], tokens[:-1]), 3), f"step {step}"
        saved = target.save_rows([slot])
        rows = target.forward(StepBatch.single(slot, [tokens[-1], *drafts], len(tokens) - 1, all_logits=True))[0]
        kept = drafts[:step % 3]
        target.restore_rows(saved, slot)
        target.forward(StepBatch.single(slot, [tokens[-1], *kept], len(tokens) - 1))
        tokens += [*kept, int(np.argmax(rows[len(kept)]))]
    proposer.close()
    assert not target.taps


def test_mtp_greedy_equals_plain(bundles):
    from lineside.runtime.engine import LLMEngine
    from lineside.runtime.generate import Generator
    from lineside.runtime.request import GenerationRequest

    b, n = bundles["w4"], 24
    rng = np.random.default_rng(11)
    prompts = [[1, *rng.integers(3, 120, m).tolist()] for m in (9, 5, 13)]
    g = Generator(b, threads=2)
    want = [list(g.stream(p, n, stop_at_eos=False)) for p in prompts]
    g.speculative = MTP
    got, drafted = [], 0
    for p in prompts:
        got.append(list(g.stream(p, n, stop_at_eos=False)))
        drafted += g.drafted
    assert got == want and drafted > 0

    limits = (n, n - 8, n - 16)
    # Drafts in every step the rows allow: on this tiny model the LM head makes an MTP step cost a third of the
    # target's, so the adaptive rule would rightly stop drafting after the first rejections.
    eager = SpeculativeConfig(SpecMethod.MTP, 3, max_rows=8, draft_cost=0.0)

    async def engine():
        eng = LLMEngine(b, backend="onnxruntime", threads=2, num_slots=3, speculative=eager)
        await eng.start()
        outs = await asyncio.gather(*(eng.submit(GenerationRequest(list(p), max_tokens=m, ignore_eos=True)).result()
                                      for p, m in zip(prompts, limits, strict=True)))
        st = eng.stats()
        await eng.stop()
        return [o[1] for o in outs], st

    got, st = asyncio.run(engine())
    assert got == [w[:m] for w, m in zip(want, limits, strict=True)]
    assert st.spec_draft_tokens_total > 0


def test_mtp_seeded_sampling_repeats_and_keeps_drafts(bundles):
    """A seeded request drafts the MTP's top token and is verified by plain decoding's draw: the text is plain
    decoding's, every time (a sampled draft spent the row's generator; the random MTP's top token is rarely the
    draw here, so kept drafts are covered by the greedy tests)."""
    from lineside.runtime.generate import Generator
    from lineside.runtime.sampling import SamplingParams

    g = Generator(bundles["w4"], threads=2)
    params = SamplingParams(temperature=1.0, seed=3)
    plain = list(g.stream([1, 5, 9, 33, 70, 12], 40, params, stop_at_eos=False))
    g.speculative = SpeculativeConfig(SpecMethod.MTP, 3, draft_cost=0.0)
    first = list(g.stream([1, 5, 9, 33, 70, 12], 40, params, stop_at_eos=False))
    assert g.drafted > 0
    assert first == plain
    assert list(g.stream([1, 5, 9, 33, 70, 12], 40, params, stop_at_eos=False)) == first


def test_mtp_without_a_module_is_one_line(bundles, mtp_ckpt, tmp_path):
    from types import SimpleNamespace

    from lineside.bundle import open_bundle
    from lineside.runtime.speculative.proposers import check_proposer, make_proposer
    from tests.cli.test_cli_errors import assert_one_line_error, run_cli

    assert_one_line_error(run_cli("generate", str(bundles["plain"]), "--prompt", "hi", "--speculative", "mtp"),
                          "no MTP module", "mtp.*")
    assert check_proposer(MTP, open_bundle(bundles["fp32"])) is None
    with pytest.raises(LinesideError, match="onnxruntime backend only") as e:
        make_proposer(MTP, open_bundle(bundles["fp32"]), SimpleNamespace(name="tensorrt"))
    assert "\n" not in str(e.value)
    from safetensors.numpy import load_file, save_file

    broken = tmp_path / "broken"
    broken.mkdir()
    for f in mtp_ckpt.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    w = load_file(str(broken / "model.safetensors"))
    save_file({k: v for k, v in w.items() if k != "mtp.0.h_proj.weight"}, str(broken / "model.safetensors"))
    assert_one_line_error(run_cli("build", str(broken), "-o", str(tmp_path / "out"), "--quant", "fp32",
                                  "--flavors", "cpu"), "mtp.0.h_proj.weight", "MTP module")


def test_hidden_ring_keeps_the_last_positions_by_slot():
    from lineside.runtime.speculative.mtp import HiddenRing

    ring = HiddenRing(2, 5, (1, 2))
    rows = np.arange(14, dtype=np.float32).reshape(7, 1, 2)
    ring.put(0, 0, rows)  # positions 0..6: 2..6 held
    assert ring.first_of_run(0, 7) == 2 and ring.first_of_run(0, 4) == 2 and ring.first_of_run(1, 7) == 7
    np.testing.assert_array_equal(ring.rows(0, 3, 7), rows[3:7])
    ring.copy(0, 1, 5)  # a move of the first 5 positions: 2..4
    assert ring.first_of_run(1, 5) == 2 and ring.first_of_run(1, 6) == 6
    ring.copy(1, 1, 4)  # onto itself: what it held below 4 stays
    np.testing.assert_array_equal(ring.rows(1, 2, 4), rows[2:4])
    ring.reset(0)
    assert ring.first_of_run(0, 7) == 7
