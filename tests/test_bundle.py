"""The typed manifest: what a build writes reads back to the same bytes, and a manifest carrying keys this
version does not know (an older producer's version key, a newer one's fields) still opens and keeps them."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from lineside.bundle import MANIFEST, FlavorEntry, Manifest, open_bundle, read_manifest
from lineside.errors import BundleError, LinesideError
from lineside.graph_io import StateUpdate


@pytest.fixture(scope="module")
def built(tiny_bundles) -> Path:
    return tiny_bundles(flavors=("cpu", "trt"), max_seq_len=64)


def _copy(built: Path, tmp_path: Path, edit) -> Path:
    """A copy of the built bundle whose manifest.json went through ``edit(raw dict)``."""
    out = tmp_path / "copy"
    shutil.copytree(built, out)
    raw = json.loads((out / MANIFEST).read_text())
    edit(raw)
    (out / MANIFEST).write_text(json.dumps(raw, indent=2, sort_keys=True))  # not a listed file: no sha to fix
    return out


def test_built_manifest_reads_back_to_the_same_bytes(built):
    text = (built / MANIFEST).read_text()
    m = read_manifest(built)
    assert json.dumps(m.to_json_dict(), indent=2, sort_keys=True) == text
    assert isinstance(m.flavors["cpu"], FlavorEntry) and m.flavors["cpu"].graph == "graphs/cpu/model.onnx"
    assert {s.update for s in m.flavors["cpu"].state} == {StateUpdate.INPLACE}
    assert {s.update for s in m.flavors["trt"].state} == {StateUpdate.APPEND}
    raw = json.loads(text)
    assert raw["flavors"]["trt"]["state"][0]["update"] == "append"  # the enum is written as its value
    assert m.graph_sha("trt") == raw["files"]["graphs/trt/model.onnx"]["sha256"]
    assert m.graph_sha("gpu") is None
    assert m.extra == {} and m.flavors["cpu"].extra == {}


def test_unknown_keys_open_and_are_kept(built, tmp_path):
    def older_and_newer(raw):
        raw["trtedge_version"] = "0.1.9"  # what a producer before the rename wrote
        raw["calibration_set"] = {"name": "line-7", "tokens": 4096}
        raw["flavors"]["cpu"]["kernel_hints"] = ["gqa"]

    path = _copy(built, tmp_path, older_and_newer)
    b = open_bundle(path)
    assert b.manifest.extra == {"trtedge_version": "0.1.9", "calibration_set": {"name": "line-7", "tokens": 4096}}
    assert b.flavor("cpu").extra == {"kernel_hints": ["gqa"]}
    assert b.manifest.to_json_dict() == json.loads((path / MANIFEST).read_text())

    from lineside.runtime.backend import StepBatch
    from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend

    be = OnnxRuntimeBackend(b, num_slots=1, threads=1)
    assert be.forward(StepBatch.single(0, [1, 2, 3], 0)).shape == (1, 1, b.config.vocab_size)


def test_partial_manifest_round_trips():
    raw = {"architecture": "llama", "config": "config.json", "max_seq_len": 8, "flavors": {}, "files": {},
           "format_version": 1, "name": "tiny"}
    m = Manifest.from_json_dict(raw)
    assert m.model_name is None and m.quantization is None and m.extra == {"name": "tiny"}
    assert m.to_json_dict() == raw  # absent optional fields stay absent


@pytest.mark.parametrize(("edit", "match"), [
    (lambda raw: raw.pop("max_seq_len"), "max_seq_len"),
    # a hand-edited manifest (it is not a listed file, so no checksum catches it): no context, or a cut one
    (lambda raw: raw.update(max_seq_len=-5), "max_seq_len -5"),
    (lambda raw: raw.update(max_seq_len=0), "max_seq_len 0"),
    (lambda raw: raw.update(max_seq_len=3.7), "max_seq_len 3.7"),
    (lambda raw: raw.update(max_seq_len="big"), "max_seq_len 'big'"),
    (lambda raw: raw["flavors"]["trt"]["state"][0].update(update="rotate"), "rotate"),
    # json reads Infinity: int() of it was an OverflowError traceback
    (lambda raw: raw["files"]["config.json"].update(size=float("inf")), "infinity"),
    (lambda raw: raw.update(adapters={"a": {"dir": "adapters/a", "rank": float("inf"), "lora_alpha": 1,
                                            "use_rslora": False, "targets": ["q"]}}), "infinity"),
])
def test_incomplete_or_unknown_is_one_line(built, tmp_path, edit, match):
    path = _copy(built, tmp_path, edit)
    with pytest.raises(BundleError, match=match) as e:
        open_bundle(path)
    assert "\n" not in str(e.value) and "rebuild the bundle" in str(e.value)


def flip_a_byte_keeping_mtime(path: Path) -> None:
    """Change one byte of ``path`` in place and set its mtime back: only the digest (and ctime) can tell."""
    st = path.stat()
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_unchanged_files_are_not_hashed_again_but_a_rewrite_is(built, tmp_path, monkeypatch):
    """The checksum cache skips files unchanged since they matched; a same-size rewrite with its mtime put
    back still changes ctime, so it is hashed and refused."""

    import lineside.bundle as bundle_mod

    out = tmp_path / "b"
    shutil.copytree(built, out)
    hashed: list[str] = []
    real = bundle_mod.sha256_file
    monkeypatch.setattr(bundle_mod, "sha256_file", lambda p: hashed.append(p.name) or real(p))
    open_bundle(out)
    first = len(hashed)
    assert first == len(read_manifest(out).files)
    open_bundle(out)
    assert len(hashed) == first  # nothing hashed the second time
    data = out / "graphs/cpu/model.onnx.data"
    flip_a_byte_keeping_mtime(data)
    with pytest.raises(BundleError, match="model.onnx.data fails its sha256 check"):
        open_bundle(out)


def test_what_is_not_a_bundle_says_what_it_is_and_what_to_pass(built, tmp_path):
    """`lineside serve model.gguf` (or a checkpoint directory, or a file inside a bundle) names the right next step:
    build a bundle from the checkpoint, or pass the bundle's directory — never `lineside build ... -o model.gguf`."""
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(20))
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(bytes(8))
    cases = [
        (gguf, f"is a checkpoint, not a bundle; build a bundle from it first: `lineside build {gguf} -o BUNDLE`"),
        (hf, f"is a checkpoint, not a bundle; build a bundle from it first: `lineside build {hf} -o BUNDLE`"),
        (built / MANIFEST, f"pass the bundle directory ({built}), not a file inside it"),
        (built / "graphs", f"pass the bundle directory ({built}), not a directory inside it"),
        (tmp_path / "nope", "not a bundle directory (it does not exist)"),
    ]
    for path, needle in cases:
        with pytest.raises(BundleError) as e:
            read_manifest(path)
        assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)
        assert path.exists() is (f"-o {path}`" not in str(e.value))  # only a path not there yet is one to build to


def test_a_missing_flavor_names_a_rebuild_that_keeps_the_others(tiny_bundle):
    """`lineside check` / `engine` / `serve --backend tensorrt` on a cpu bundle said 'rebuild with --flavors trt':
    followed literally, the cpu graph is gone and onnxruntime runs the trt graph (dequantizing every step)."""
    from lineside.bundle import manifest_flavor

    with pytest.raises(BundleError) as e:
        manifest_flavor(tiny_bundle, read_manifest(tiny_bundle), "trt")
    assert str(e.value).endswith("rebuild with --flavors cpu,trt"), str(e.value)


def _graph_record(raw, key, value):
    raw["flavors"]["cpu"][key] = value


@pytest.mark.parametrize(("edit", "named"), [
    # the manifest is not checksummed: a bundle copied from elsewhere may name any path in it
    (lambda raw: raw["files"].update({"../outside.bin": {"size": 1, "sha256": "0" * 64}}), "'../outside.bin'"),
    (lambda raw: raw["files"].update({"/etc/hostname": {"size": 1, "sha256": "0" * 64}}), "'/etc/hostname'"),
    (lambda raw: raw["files"].update({"tokenizer/a\n../../x": {"size": 1, "sha256": "0" * 64}}), "file"),
    (lambda raw: raw.update(config="/etc/hostname"), "config '/etc/hostname'"),
    (lambda raw: raw["flavors"]["cpu"].update(graph="graphs/../../victim/model.onnx"), "cpu graph"),
    (lambda raw: _graph_record(raw, "lora_graph", "../../../x.onnx"), "cpu LoRA graph"),
    (lambda raw: _graph_record(raw, "draft_graphs", {"1": {"graph": "/tmp/draft.onnx"}}), "cpu draft graph 1"),
    (lambda raw: _graph_record(raw, "mtp_graph", {"graph": "graphs/cpu/../../../m.onnx"}), "cpu MTP graph"),
    (lambda raw: raw.update(adapters={"a": {"dir": "../adapters/a", "rank": 1, "lora_alpha": 1, "use_rslora": False,
                                            "targets": ["q"]}}), "adapter 'a'"),
])
def test_a_path_leaving_the_bundle_is_refused(built, tmp_path, edit, named):
    """Paths are joined to the bundle's directory to read, copy and write beside: one leaving it is refused by
    name when the manifest is read, before anything opens it."""
    path = _copy(built, tmp_path, edit)
    with pytest.raises(BundleError, match="not a path inside the bundle") as e:
        read_manifest(path)
    assert named in str(e.value) and "\n" not in str(e.value)


def test_a_listed_file_linked_outside_the_bundle_is_refused(built, tmp_path):
    """A symlink in a copied bundle (or a linked folder) that leads out of it is refused by name, even when the
    file it reaches has the listed bytes."""
    path = _copy(built, tmp_path, lambda raw: None)
    outside = tmp_path / "elsewhere"
    shutil.move(path / "tokenizer", outside)
    (path / "tokenizer").symlink_to(outside, target_is_directory=True)
    with pytest.raises(BundleError, match=r"bundle file tokenizer/\S+ is a link to .*elsewhere.*outside the bundle"):
        open_bundle(path)
    # a link inside the bundle, or to the bundle itself, is no escape
    shutil.move(outside, path / "tok-real")
    (path / "tokenizer").unlink()
    (path / "tokenizer").symlink_to("tok-real", target_is_directory=True)
    link = tmp_path / "current"
    link.symlink_to(path, target_is_directory=True)
    assert open_bundle(link).manifest.files


def _state(raw, flavor, **fields):
    raw["flavors"][flavor]["state"][0].update(fields)


@pytest.mark.parametrize(("flavor", "fields"), [
    ("cpu", dict(shape=["batch", 2, "max_seq", -1])),  # numpy: "negative dimensions are not allowed"
    ("cpu", dict(shape=["batch", 2, "max_seq", 10 ** 13])),  # terabytes asked of the allocator
    ("cpu", dict(shape=["batch", 2, "max_seq", "heads"])),  # KeyError
    ("cpu", dict(shape=["batch", 2, "max_seq", float("inf")])),  # OverflowError
    ("cpu", dict(shape=["batch", 2, "max_seq", 17])),  # onnxruntime refused it in the first step only
    ("cpu", dict(shape=["batch", 2, "max_seq"])),
    ("cpu", dict(dtype="float16")),
    ("cpu", dict(input="past_key.99")),
    ("trt", dict(shape=["batch", 2, "past_seq", 5])),
])
def test_a_state_the_graph_does_not_take_is_one_line(built, tmp_path, flavor, fields):
    """The manifest's decode-state shapes size the KV arena; one that disagrees with the graph's input is refused
    naming the state when the backend loads, not a traceback or a failing first step."""
    from lineside.runtime.backend import StepBatch
    from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend

    b = open_bundle(_copy(built, tmp_path, lambda raw: _state(raw, flavor, **fields)))
    name = fields.get("input", b.flavor(flavor).state[0].input)
    with pytest.raises(LinesideError, match=rf"state {re.escape(name)} in the manifest .*rebuild the bundle") as e:
        OnnxRuntimeBackend(b, num_slots=1, flavor=flavor, threads=1).forward(StepBatch.single(0, [1, 2, 3], 0))
    assert "\n" not in str(e.value)


def test_a_manifest_without_graphs_is_one_line(built, tmp_path):
    """``flavors: {}`` (a hand-made or cut manifest) was a StopIteration traceback when a backend picked its graph."""
    from lineside.runtime.onnxruntime_backend import OnnxRuntimeBackend

    b = open_bundle(_copy(built, tmp_path, lambda raw: raw.update(flavors={})))
    with pytest.raises(BundleError, match="has no 'cpu' graph \\(it has: none\\); rebuild with --flavors cpu"):
        OnnxRuntimeBackend(b, num_slots=1, threads=1)


@pytest.mark.parametrize(("edit", "match"), [
    (lambda t: "tokenizer", "tokenizer record is 'tokenizer', not an object"),  # dict("tokenizer"): ValueError
    (lambda t: {**t, "eos_token_ids": 2}, "eos_token_ids 2"),  # list(2): TypeError
    (lambda t: {**t, "bos_token_id": "<s>"}, "bos_token_id '<s>'"),
    (lambda t: {**t, "chat_template": [1, 2]}, "chat template is list"),  # t.get on an int: AttributeError
    (lambda t: {**t, "chat_template": 5}, "chat template is int"),  # `"developer" in 5`: TypeError
])
def test_a_malformed_tokenizer_record_is_one_line(built, tmp_path, edit, match):
    from lineside.runtime.tokenizer import Tokenizer

    b = open_bundle(_copy(built, tmp_path, lambda raw: raw.update(tokenizer=edit(raw["tokenizer"]))))
    with pytest.raises(BundleError, match=re.escape(match)) as e:
        Tokenizer.from_bundle(b).apply_chat_template([{"role": "user", "content": "hi"}])
    assert "\n" not in str(e.value) and "rebuild the bundle" in str(e.value)


def test_named_chat_templates_take_default(built, tmp_path):
    from lineside.runtime.tokenizer import Tokenizer

    named = [{"name": "tool_use", "template": "T{{ messages[0].content }}"},
             {"name": "default", "template": "D{{ messages[0].content }}"}]
    b = open_bundle(_copy(built, tmp_path, lambda raw: raw["tokenizer"].update(chat_template=named)))
    assert Tokenizer.from_bundle(b).chat_template == "D{{ messages[0].content }}"


@pytest.mark.parametrize(("edit", "needles"), [
    # a bundle from a lineside whose format moved on: the way forward is this runtime's upgrade, not a rebuild
    # (the machine running it often has no checkpoint to rebuild from)
    (lambda raw: raw.update(format_version=2, lineside_version="0.9.0"),
     ["bundle format 2", "lineside 0.9.0", "upgrade lineside", "pip install -U lineside"]),
    (lambda raw: raw.update(format_version=3), ["bundle format 3", "upgrade lineside"]),
    # same format, a newer producer's record this version cannot read: upgrade named before the rebuild
    (lambda raw: (raw.update(lineside_version="99.1.0"),
                  raw["flavors"]["trt"]["state"][0].update(update="rotate")),
     ["lineside 99.1.0", "upgrade lineside", "rebuild the bundle"]),
])
def test_a_bundle_from_a_newer_lineside_says_to_upgrade(built, tmp_path, edit, needles):
    path = _copy(built, tmp_path, edit)
    with pytest.raises(BundleError) as e:
        open_bundle(path)
    msg = str(e.value)
    assert "\n" not in msg and all(n in msg for n in needles), msg


def test_an_older_format_still_says_to_rebuild(built, tmp_path):
    path = _copy(built, tmp_path, lambda raw: raw.update(format_version=0))
    with pytest.raises(BundleError, match="bundle format 0, this lineside reads 1; rebuild the bundle") as e:
        open_bundle(path)
    assert "upgrade" not in str(e.value)


def test_a_bundle_opened_through_a_link_stays_the_version_it_was_when_opened(built, tmp_path, monkeypatch):
    """`serve /opt/lineside/current` while `jetson push` switches current to another version: the manifest read
    through the link and the files read through it later (the check, then the graphs, the tokenizer) are one
    version's, never the old manifest's checksums held against the new version's files."""
    import lineside.bundle as bundle_mod

    old = _copy(built, tmp_path, lambda raw: None)
    new = tmp_path / "new"
    shutil.copytree(built, new)
    (new / "config.json").write_text((new / "config.json").read_text() + "\n")  # another version: other bytes
    bundle_mod.write_manifest(new, read_manifest(new))
    current = tmp_path / "current"
    current.symlink_to(old, target_is_directory=True)
    real = bundle_mod.read_manifest

    def read_then_switch(path):
        m = real(path)
        flipped = tmp_path / "current.new"
        flipped.symlink_to(new, target_is_directory=True)
        flipped.replace(current)  # what push's switch does: a rename over the link
        return m

    monkeypatch.setattr(bundle_mod, "read_manifest", read_then_switch)
    b = open_bundle(current)
    assert b.file("config.json").read_bytes() == (old / "config.json").read_bytes()
    assert b.manifest.files["config.json"].size == (old / "config.json").stat().st_size


@pytest.mark.parametrize(("edit", "match"), [
    # each opened with nothing checked: an emptied or mistyped file list checks no file at all
    (lambda raw: raw.update(files={}), "config.json is not among"),
    (lambda raw: raw.update(files=[]), "no file list"),
    (lambda raw: raw.update(files=None), "no file list"),
    (lambda raw: raw["files"].pop("config.json"), "config.json is not among"),
    (lambda raw: raw["files"].pop("graphs/cpu/model.onnx"), "cpu graph graphs/cpu/model.onnx is not among"),
    (lambda raw: raw["files"].pop("graphs/trt/model.onnx"), "trt graph graphs/trt/model.onnx is not among"),
])
def test_a_file_list_that_leaves_out_what_is_read_is_refused(built, tmp_path, edit, match):
    """The manifest is not checksummed: a file list that lost the config or a graph (a hand edit, a bad merge)
    opened the bundle and ran whatever bytes those files held, unchecked."""
    path = _copy(built, tmp_path, edit)
    with pytest.raises(BundleError, match=match) as e:
        open_bundle(path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("damage", ["edit", "truncate"])
def test_a_changed_file_is_refused_with_how_to_rebuild(built, tmp_path, damage):
    """A file edited after the build (a hand-tuned chat template, a bad copy) is one line naming it, how to get a good
    copy and the command that rebuilds the bundle from the checkpoint it was built from."""
    out = tmp_path / "b"
    shutil.copytree(built, out)
    f = out / "tokenizer" / "tokenizer_config.json"
    text = f.read_text()
    f.write_text(text.replace("{", "[", 1) if damage == "edit" else text[:-2])
    source = read_manifest(out).source["path"]
    with pytest.raises(BundleError) as e:
        open_bundle(out)
    msg = str(e.value)
    assert "\n" not in msg and "tokenizer/tokenizer_config.json" in msg and "copy the bundle again" in msg
    assert f"lineside build {source} -o {out} --force" in msg, msg
