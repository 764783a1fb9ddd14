"""`lineside lora add/list`, `lineside logits/generate --lora` as a user runs them, and the one-line refusals."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from lineside.bundle import open_bundle
from tests.cli.cli_run import assert_one_line_error, run_cli, tree_snapshot, unreadable_dirs
from tests.conftest import make_peft_adapter

IDS = [1, 17, 42, 5, 99, 250, 3]


@pytest.fixture(scope="module")
def lora_bundle_copy(tiny_bundles, tmp_path_factory):
    """A private copy of the tiny Llama fp32 bundle with LoRA graphs (the tests add adapters to it)."""
    src = tiny_bundles(variant="llama-gqa", quant="fp32", flavors=("cpu", "trt"), max_seq_len=64, accuracy_level=0,
                       max_lora_rank=8)
    dst = tmp_path_factory.mktemp("lora-cli") / "tiny-llama"
    shutil.copytree(src, dst)
    return dst


def test_add_list_and_logits_with_the_adapter(lora_bundle_copy, peft_adapter, tiny_dense, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lineside.runtime.lora_stack import LoraSlotsConfig
    from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend

    adapter = peft_adapter("llama-gqa", "all-rslora")
    # a bundle that has served holds onnxruntime's graph caches beside its graphs: `lora add` must not list them
    OnnxRuntimeBackend(open_bundle(lora_bundle_copy), lora=LoraSlotsConfig(1, 8))
    assert list(lora_bundle_copy.glob("graphs/cpu/*.ort-opt.onnx"))
    proc = run_cli("lora", "add", str(lora_bundle_copy), str(adapter), "--name", "line-3")
    assert proc.returncode == 0, proc.stderr
    assert "adapter line-3 added (rank 8" in proc.stdout
    b = open_bundle(lora_bundle_copy)  # verifies every checksum, the adapter's files included
    assert {"adapters/line-3/adapter_config.json", "adapters/line-3/adapter_model.safetensors"} <= set(b.manifest.files)
    assert not any("ort-opt" in f for f in b.manifest.files)
    entry = b.manifest.adapters["line-3"]
    assert entry.rank == 8 and entry.use_rslora and len(entry.targets) == 7
    listed = run_cli("lora", "list", str(lora_bundle_copy))
    assert listed.returncode == 0 and "line-3\trank 8\talpha 16 rslora" in listed.stdout, listed.stdout

    base = AutoModelForCausalLM.from_pretrained(tiny_dense("llama-gqa"), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = PeftModel.from_pretrained(base, adapter).eval()(torch.tensor([IDS])).logits[0].numpy()
    for flavor, mode in (("cpu", "decode"), ("trt", "prefill")):
        out = tmp_path / f"{flavor}.npy"
        proc = run_cli("logits", str(lora_bundle_copy), "--ids", ",".join(map(str, IDS)), "-o", str(out),
                       "--mode", mode, "--flavor", flavor, "--lora", "line-3")
        assert proc.returncode == 0, proc.stderr
        got = np.load(out)
        assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-4, flavor

    # generate --lora: every step with the adapter — the text a Generator with it in its slot writes
    from lineside.runtime.adapters import bundle_adapter
    from lineside.runtime.generate import Generator

    gen = Generator(b, backend=OnnxRuntimeBackend(b, num_slots=1, lora=LoraSlotsConfig(1, 8)))
    gen.backend.load_adapter(1, bundle_adapter(b, "line-3"))
    gen.adapter = 1
    args = ("--prompt", "the line", "--max-tokens", "6", "--backend", "onnxruntime")
    ids = gen.stream(gen.tokenizer.encode("the line"), 6)
    want = gen.tokenizer.decode(list(ids))
    with_adapter = run_cli("generate", str(lora_bundle_copy), *args, "--lora", "line-3")
    without = run_cli("generate", str(lora_bundle_copy), *args)
    assert with_adapter.returncode == 0 and without.returncode == 0, with_adapter.stderr + without.stderr
    assert with_adapter.stdout == want + "\n" and with_adapter.stdout != without.stdout


def test_refusals_are_one_line(lora_bundle_copy, tiny_bundles, peft_adapter, tiny_dense, tmp_path):
    before = _bundle_files(lora_bundle_copy)
    manifest = (lora_bundle_copy / "manifest.json").read_text()
    cases = [
        # an adapter for another shape of model (head_dim 32: q/k/v are wider)
        ((str(peft_adapter("llama-headdim", "qv")), "--name", "wide"), ("shape", "another model")),
        # an adapter for another architecture
        ((str(peft_adapter("qwen2-bias-tied", "qv")), "--name", "qwen"), ("qwen2", "llama")),
        # rank above the bundle's slots
        ((str(make_peft_adapter(tiny_dense("llama-gqa"), tmp_path / "r16", r=16, lora_alpha=16,
                                target_modules=["q_proj"])), "--name", "big"),
         ("rank 16", "rebuild the bundle with --max-lora-rank 16")),  # `lora add` has no such flag: say `build`'s
        ((str(tmp_path / "nowhere"), "--name", "x"), ("no such adapter directory",)),
        ((str(peft_adapter("llama-gqa", "qv")), "--name", "bad/name"), ("adapter name",)),
        # a trailing newline: the name's pattern ended in "$", which matches before one ("adapters/x\n", a model
        # name with a newline in /v1/models)
        ((str(peft_adapter("llama-gqa", "qv")), "--name", "line-3\n"), ("adapter name", "'line-3\\n'")),
        # the bundle's own served name: `serve` would answer it with the base model (and now refuses the bundle)
        ((str(peft_adapter("llama-gqa", "qv")), "--name", "tiny-llama"), ("'tiny-llama'", "base model")),
    ]
    for args, needles in cases:
        assert_one_line_error(run_cli("lora", "add", str(lora_bundle_copy), *args), *needles)
    assert _bundle_files(lora_bundle_copy) == before  # nothing half-added
    assert (lora_bundle_copy / "manifest.json").read_text() == manifest
    plain = tiny_bundles(variant="llama-gqa", quant="fp32", flavors=("cpu",), max_seq_len=64)
    assert_one_line_error(run_cli("lora", "add", str(plain), str(peft_adapter("llama-gqa", "qv")), "--name", "a"),
                          "--max-lora-rank")
    assert_one_line_error(run_cli("generate", str(plain), "--prompt", "hi", "--lora", "a"),  # not "lora add"
                          "has no LoRA graphs", "--max-lora-rank")
    assert_one_line_error(run_cli("logits", str(lora_bundle_copy), "--ids", "1,2", "-o", str(tmp_path / "x.npy"),
                                  "--lora", "missing"), "no adapter 'missing'")
    assert_one_line_error(run_cli("generate", str(lora_bundle_copy), "--prompt", "hi", "--lora", "missing"),
                          "no adapter 'missing'")
    assert_one_line_error(run_cli("chat", str(lora_bundle_copy), "--lora", "missing"), "no adapter 'missing'")
    assert_one_line_error(run_cli("generate", str(lora_bundle_copy), "--prompt", "hi", "--lora", "x",
                                  "--speculative", "ngram"), "--speculative does not run with --lora")
    edits = [
        ({"use_dora": True}, ("DoRA",)),
        # activated LoRA (peft's aLoRA) adapts only the tokens from its invocation sequence on: applied to every
        # token, as these graphs would, its logits are not peft's (it was added and served so)
        ({"alora_invocation_tokens": [17, 42]}, ("alora_invocation_tokens",)),
        # malformed configs: one line, not a traceback
        ({"alpha_pattern": ["q_proj"]}, ("alpha_pattern",)),
        ({"lora_alpha": None}, ("lora_alpha",)),
        ({"alpha_pattern": {"q_proj": "high"}}, ("alpha_pattern",)),
    ]
    for i, (edit, needles) in enumerate(edits):
        broken = tmp_path / f"broken{i}"
        shutil.copytree(peft_adapter("llama-gqa", "qv"), broken)
        conf = json.loads((broken / "adapter_config.json").read_text())
        (broken / "adapter_config.json").write_text(json.dumps({**conf, **edit}))
        assert_one_line_error(run_cli("lora", "add", str(lora_bundle_copy), str(broken), "--name", "d"), *needles)


def test_an_adapter_path_the_os_cannot_look_up_is_one_line(lora_bundle_copy, tmp_path):
    """A path too long, a symlink loop, or a directory whose files' paths pass PATH_MAX: the OSError of looking
    up adapter_config.json escaped lora.py and printed as a bare OS error with the whole 4 KB path."""
    before = _bundle_files(lora_bundle_copy)
    paths = unreadable_dirs(tmp_path)
    line = assert_one_line_error(run_cli("lora", "add", str(lora_bundle_copy), str(paths["deep"]), "--name", "d"),
                                 "the adapter directory cannot be read (File name too long)", "PEFT adapter directory")
    assert len(line) < 400, line  # the 4 KB path is elided, not echoed whole
    assert_one_line_error(run_cli("lora", "add", str(lora_bundle_copy), str(paths["too long"]), "--name", "d"),
                          "File name too long")
    assert_one_line_error(run_cli("lora", "add", str(lora_bundle_copy), str(paths["loop"]), "--name", "d"))
    assert _bundle_files(lora_bundle_copy) == before


def _bundle_files(bundle) -> set[str]:
    """Every path in the bundle but the verified-checksums stamp, a cache any open may write (checksum_cache.py)."""
    from lineside import checksum_cache

    return tree_snapshot(bundle) - {checksum_cache.NAME}


def test_add_a_bfloat16_adapter(lora_bundle_copy, peft_adapter, tmp_path):
    """A bf16 model's PEFT adapter is saved in bfloat16, which safetensors.numpy cannot read in a process that
    has not imported ml_dtypes (`lora add`'s): it was refused as 'data type bfloat16 not understood; it must hold
    float32, float16 or bfloat16 tensors'."""
    from safetensors.torch import load_file, save_file

    adapter = tmp_path / "bf16"
    shutil.copytree(peft_adapter("llama-gqa", "qv"), adapter)
    weights = adapter / "adapter_model.safetensors"
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(str(weights)).items()}, str(weights))
    proc = run_cli("lora", "add", str(lora_bundle_copy), str(adapter), "--name", "bf16-line", fresh=True)
    assert proc.returncode == 0, proc.stderr
    assert "adapter bf16-line added" in proc.stdout


def test_an_auto_mapping_that_is_not_an_object_is_ignored(lora_bundle_copy, peft_adapter, tmp_path):
    """adapter_config.json's auto_mapping only informs (PEFT reads the base model from base_model_name_or_path);
    a hand-written one holding a class name as a string was an AttributeError traceback."""
    odd = tmp_path / "odd"
    shutil.copytree(peft_adapter("llama-gqa", "qv"), odd)
    conf = json.loads((odd / "adapter_config.json").read_text())
    (odd / "adapter_config.json").write_text(json.dumps({**conf, "auto_mapping": "LlamaForCausalLM"}))
    proc = run_cli("lora", "add", str(lora_bundle_copy), str(odd), "--name", "odd-mapping")
    assert proc.returncode == 0, proc.stderr
    assert "odd-mapping" in open_bundle(lora_bundle_copy).manifest.adapters


def test_replacing_an_adapter_that_fails_midway_leaves_a_bundle_that_opens(tiny_bundles, peft_adapter, tiny_dense,
                                                                           tmp_path, monkeypatch):
    """`lora add --force` over an adapter swapped its files in, then rewrote the manifest: a disk full (or a
    Ctrl-C) between the two left the manifest holding the old adapter's sha256 for the new files, and every
    command then refused the whole bundle ("fails its sha256 check")."""
    import errno

    from lineside.build import lora_commands

    bundle = tmp_path / "b"
    shutil.copytree(tiny_bundles(variant="llama-gqa", quant="fp32", flavors=("cpu", "trt"), max_seq_len=64,
                                 accuracy_level=0, max_lora_rank=8), bundle)
    lora_commands.add(bundle, peft_adapter("llama-gqa", "qv"), name="line-3")
    other = make_peft_adapter(tiny_dense("llama-gqa"), tmp_path / "other", seed=7, r=4, lora_alpha=8,
                              target_modules=["q_proj", "v_proj"])
    real = lora_commands.add_to_manifest

    def full_disk(bundle_dir, manifest, files):
        if files:  # the write that lists the new adapter's files
            raise OSError(errno.ENOSPC, "No space left on device", "manifest.json.tmp")
        return real(bundle_dir, manifest, files)

    monkeypatch.setattr(lora_commands, "add_to_manifest", full_disk)
    with pytest.raises(OSError):
        lora_commands.add(bundle, other, name="line-3", force=True)
    open_bundle(bundle)  # still whole: it may lack the adapter, but what it lists is what it holds
    monkeypatch.setattr(lora_commands, "add_to_manifest", real)
    proc = run_cli("lora", "add", str(bundle), str(other), "--name", "line-3")  # again, once there is room
    assert proc.returncode == 0, proc.stderr
    b = open_bundle(bundle)
    assert (bundle / b.manifest.adapters["line-3"].dir / "adapter_model.safetensors").read_bytes() == \
        (other / "adapter_model.safetensors").read_bytes()


def test_adapters_added_at_the_same_time_are_all_kept(tiny_bundles, peft_adapter, tmp_path, monkeypatch):
    """`lora add` read the manifest, checked and copied the adapter, then wrote the manifest back: two adds at
    once (a script adding adapters with `&`) each wrote the manifest it had read plus its own adapter, so all
    said "added" and the bundle listed one (the others' files sat there unlisted, never served)."""
    import threading

    from lineside.build import lora_commands

    bundle = tmp_path / "b"
    shutil.copytree(tiny_bundles(variant="llama-gqa", quant="fp32", flavors=("cpu", "trt"), max_seq_len=64,
                                 accuracy_level=0, max_lora_rank=8), bundle)
    adapter = peft_adapter("llama-gqa", "qv")
    read, inside, second = lora_commands.read_adapter, threading.Event(), threading.Event()

    def read_while_another_add_runs(path, cfg, name):
        if name == "first":
            inside.set()
            second.wait(timeout=2)  # the other add, unless it waits for this one to finish
        else:
            second.set()
        return read(path, cfg, name)

    monkeypatch.setattr(lora_commands, "read_adapter", read_while_another_add_runs)
    errors = []

    def add(name):
        try:
            lora_commands.add(bundle, adapter, name=name)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    first = threading.Thread(target=add, args=("first",))
    first.start()
    assert inside.wait(timeout=30)
    add("second")
    first.join(timeout=30)
    assert not errors, errors
    assert set(open_bundle(bundle).manifest.adapters) == {"first", "second"}
