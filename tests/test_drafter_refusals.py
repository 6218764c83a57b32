"""Drafters given by a path are refused up front, in one line naming the drafter, the file or field at fault and
what to do: released heads under a class they are not published with or made for another target family, unreadable
files and configs, layout errors that need no target; and a batch job checks its drafter on the driver, before Ray
starts or anything is written. The heads are written by test_released_drafters.py's writers in the authors'
layouts."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from mmspec_ray.batch.cli import main as job_main
from mmspec_ray.cli import main as cli_main
from mmspec_ray.drafters.base import load_drafter
from mmspec_ray.drafters.eagle import Eagle2Drafter
from mmspec_ray.drafters.files import DrafterError
from mmspec_ray.drafters.released import recognise
from mmspec_ray.targets import wrap
from test_released_drafters import check_eagle3_reference, write_eagle1, write_eagle3, write_msd
from tiny import tiny_llava
from tiny_qwen2_5_vl import tiny_qwen2_5_vl


@pytest.fixture(scope="module")
def llava():
    torch.manual_seed(0)
    return wrap(*tiny_llava())


@pytest.fixture(scope="module")
def qwen():
    torch.manual_seed(0)
    return wrap(*tiny_qwen2_5_vl())


def edit(path: Path, **changes) -> None:
    """Change config.json's fields (None: drop the field)."""
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def refused(path: Path, target, *named: str) -> str:
    """load_drafter refuses the drafter at `path` in one line naming it and each of `named`."""
    with pytest.raises(DrafterError) as e:
        load_drafter(str(path), target)
    msg = str(e.value)
    assert len(msg.splitlines()) == 1 and str(path) in msg, msg
    assert all(n in msg for n in named), msg
    return msg


# ---------------- architectures: the classes each layout is published with ----------------

@pytest.mark.parametrize("archs, named", [
    (["MedusaModel"], "['MedusaModel'] with EAGLE-3 weights"),
    (["LlavaForConditionalGeneration"], "['LlavaForConditionalGeneration'] with EAGLE-3 weights"),
    ("LlamaForCausalLMEagle3", "is not a list of class names"),
    (["LlamaForCausalLMEagle3", "LlamaForCausalLM"], "with EAGLE-3 weights"),
])
def test_eagle3_weights_under_a_class_they_are_not_published_with_are_refused(llava, tmp_path, archs, named):
    write_eagle3(tmp_path / "h", llava, "specforge", vd=100)
    edit(tmp_path / "h", architectures=archs)
    msg = refused(tmp_path / "h", llava, named, "config.json")
    if isinstance(archs, list):
        assert "accepted are LlamaForCausalLM, LlamaForCausalLMEagle3, Eagle3LlamaForCausalLM" in msg


def test_eagle1_weights_labelled_eagle3_or_medusa_are_refused(llava, tmp_path):
    write_eagle1(tmp_path / "h", llava)
    edit(tmp_path / "h", architectures=["LlamaForCausalLMEagle3"])
    refused(tmp_path / "h", llava, "names an EAGLE-3 head", "eagle-safeailab", "layers.0")
    edit(tmp_path / "h", architectures=["MedusaModel"])
    refused(tmp_path / "h", llava, "['MedusaModel'] is not a class this layout is published with", "accepted:")


def test_an_eagle1_head_naming_a_vlm_class_must_name_the_targets(llava, tmp_path):
    """EAGLE-lineage configs copy their base model's: a VLM class there names the target it was made for."""
    write_eagle1(tmp_path / "h", llava)
    edit(tmp_path / "h", architectures=["LlavaForConditionalGeneration"])
    load_drafter(str(tmp_path / "h"), llava)
    edit(tmp_path / "h", architectures=["Qwen2_5_VLForConditionalGeneration"])
    refused(tmp_path / "h", llava, "built for another target", "['Qwen2_5_VLForConditionalGeneration'] vs the "
            "target's ['LlavaForConditionalGeneration']")


def test_vllm_eagle3_heads_run_at_their_own_rope_base(tmp_path):
    """vLLM's spelling `Eagle3LlamaForCausalLM` is its own layout, read with its config's RoPE (here 1e6), not as a
    SafeAILab head at base 10000: the first draft equals a reference forward at 1e6."""
    torch.manual_seed(0)
    target = wrap(*tiny_llava(init=0.3, layers=8))
    state = write_eagle3(tmp_path / "h", target, "specforge", vd=target.vocab_size // 2, seed=21, rope_theta=1e6)
    edit(tmp_path / "h", architectures=["Eagle3LlamaForCausalLM"])
    info = recognise(tmp_path / "h")
    assert info.layout == "eagle3-vllm" and info.describe()["rope_theta"] == 1e6
    state = {k: v.bfloat16().float() if v.is_floating_point() else v for k, v in state.items()}
    check_eagle3_reference(target, tmp_path / "h", state, [2, 4, 5], 1e6)


# ---------------- the target family, M-RoPE and transformers 5's rope_parameters ----------------

def test_a_qwen_mrope_head_is_refused_on_llava_naming_both_families(llava, tmp_path):
    """Same sizes as the tiny LLaVA, made for Qwen2.5-VL: refused by `target_model_type`, and by its M-RoPE."""
    write_eagle3(tmp_path / "h", llava, "specforge", vd=100,
                 rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})
    edit(tmp_path / "h", target_model_type="qwen2_5_vl")
    refused(tmp_path / "h", llava, "target_model_type qwen2_5_vl vs the target's llava",
            "M-RoPE positions (mrope_section [2, 3, 3]) vs the target's 1-D RoPE", "use a head made for llava")
    edit(tmp_path / "h", target_model_type=None)
    refused(tmp_path / "h", llava, "M-RoPE positions")


def test_msd_heads_load_only_on_the_family_they_name(qwen, tmp_path):
    """MSD's `model_type` (llava, qwen2_vl) is the target family: a Qwen2-VL head on Qwen2.5-VL is refused."""
    write_msd(tmp_path / "q", qwen, "qwen2_vl")
    refused(tmp_path / "q", qwen, "(msd-authors) was built for another target", "model_type qwen2_vl vs the "
            "target's qwen2_5_vl")
    write_msd(tmp_path / "l", qwen, "llava")
    refused(tmp_path / "l", qwen, "model_type llava vs the target's qwen2_5_vl")


def test_rope_parameters_alone_give_the_heads_mrope_and_base(qwen, tmp_path):
    """A SpecForge head whose config carries its RoPE only in transformers 5's `rope_parameters` runs M-RoPE at that
    base (checked against a reference forward on the target's own rotary embedding), and inspect says so."""
    from test_released_drafters import image_request

    rope = dict(qwen.text_config.rope_parameters)
    state = write_eagle3(tmp_path / "h", qwen, "specforge", vd=qwen.vocab_size // 2, seed=9)
    edit(tmp_path / "h", rope_theta=None, rope_parameters={"rope_type": "default", "rope_theta": rope["rope_theta"],
                                                           "mrope_section": list(rope["mrope_section"])})
    state = {k: v.bfloat16().float() if v.is_floating_point() else v for k, v in state.items()}
    check_eagle3_reference(qwen, tmp_path / "h", state, [1, 1, 1], rope["rope_theta"], req=image_request(7),
                           mrope=True)
    edit(tmp_path / "h", rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]})
    info = recognise(tmp_path / "h").describe()
    assert info["positions"] == "M-RoPE, sections [2, 3, 3]" and info["rope_theta"] == 1e6
    assert load_drafter(str(tmp_path / "h"), qwen).head.cfg.rope_theta == 1e6
    edit(tmp_path / "h", rope_theta=10000.0)
    refused(tmp_path / "h", qwen, "rope_theta 10000.0 and rope_parameters.rope_theta 1000000.0 disagree")


def test_a_safeailab_head_says_its_config_rope_theta_is_not_used(llava, tmp_path):
    write_eagle3(tmp_path / "h", llava, "safeailab", vd=100, rope_theta=1e6)
    info = recognise(tmp_path / "h").describe()
    assert info["rope_theta"] == 10000.0 and "rope_theta 1000000.0 is not used" in info["note"]


# ---------------- files that cannot be read, and layout errors that need no target ----------------

def test_unreadable_files_and_fields_are_named(llava, tmp_path):
    write_eagle1(tmp_path / "bin", llava)
    truncate(tmp_path / "bin" / "pytorch_model.bin")
    refused(tmp_path / "bin", llava, "weight file pytorch_model.bin cannot be read", "truncated",
            "download the drafter again")
    write_eagle3(tmp_path / "st", llava, "specforge", vd=100)
    truncate(tmp_path / "st" / "model.safetensors")
    refused(tmp_path / "st", llava, "weight file model.safetensors cannot be read", "truncated")
    write_eagle3(tmp_path / "js", llava, "specforge", vd=100)
    (tmp_path / "js" / "config.json").write_text('{"hidden_size": 64,')
    refused(tmp_path / "js", llava, "config.json cannot be read (JSONDecodeError", "restore the config.json")
    write_eagle3(tmp_path / "dv", llava, "safeailab", vd=100)
    edit(tmp_path / "dv", draft_vocab_size=None)
    refused(tmp_path / "dv", llava, "no draft_vocab_size, but lm_head.weight has 100 rows",
            'add "draft_vocab_size": 100 to config.json')


def test_an_own_drafters_truncated_weights_and_bad_config_are_named(llava, tmp_path):
    Eagle2Drafter.random(llava).head.save(tmp_path / "d")
    load_drafter(str(tmp_path / "d"), llava)
    edit(tmp_path / "d", num_heads="four")
    refused(tmp_path / "d", llava, "config.json field num_heads")
    edit(tmp_path / "d", num_heads=llava.text_config.num_attention_heads)
    truncate(tmp_path / "d" / "model.safetensors")
    refused(tmp_path / "d", llava, "weight file model.safetensors cannot be read")


def broken_heads(llava, root: Path) -> dict[str, tuple[Path, str]]:
    """name -> (a head wrong in one way that needs no target to see, what its refusal names)."""
    heads = {}
    write_eagle3(root / "fc_norm", llava, "specforge", vd=100)
    edit(root / "fc_norm", fc_norm=True)
    heads["fc_norm"] = (root / "fc_norm", "EAGLE-3.1 options")
    state = write_eagle3(root / "d2t", llava, "safeailab", vd=100)
    state["d2t"][-1] += 400  # a target id past the vocabulary
    torch.save({k: v.half() if v.is_floating_point() else v for k, v in state.items()},
               root / "d2t" / "pytorch_model.bin")
    heads["d2t"] = (root / "d2t", "d2t maps draft ids to target ids that are not strictly increasing")
    write_eagle3(root / "dv", llava, "specforge", vd=100)
    edit(root / "dv", draft_vocab_size=None)
    heads["draft_vocab_size"] = (root / "dv", "no draft_vocab_size")
    write_eagle1(root / "trunc", llava)
    truncate(root / "trunc" / "pytorch_model.bin")
    heads["truncated"] = (root / "trunc", "pytorch_model.bin cannot be read")
    return heads


@pytest.mark.parametrize("case", ["fc_norm", "d2t", "draft_vocab_size", "truncated"])
def test_inspect_refuses_layout_errors_without_a_target_with_exit_1(llava, ckpt, tmp_path, capsys, case):
    path, named = broken_heads(llava, tmp_path)[case]
    for extra in ([], ["--target", ckpt]):
        assert cli_main(["drafter", "inspect", str(path), *extra]) == 1
        out = capsys.readouterr().out.strip()
        assert len(out.splitlines()) == 1 and out.startswith("refused: drafter ") and named in out, out


def test_inspect_refuses_another_family_with_exit_1(llava, ckpt, tmp_path, capsys):
    write_eagle3(tmp_path / "h", llava, "specforge", vd=100)
    edit(tmp_path / "h", target_model_type="qwen2_5_vl")
    assert cli_main(["drafter", "inspect", str(tmp_path / "h")]) == 0
    assert "target_model_type: qwen2_5_vl" in capsys.readouterr().out
    assert cli_main(["drafter", "inspect", str(tmp_path / "h"), "--target", ckpt]) == 1
    out = capsys.readouterr().out
    assert f"fits {ckpt}: no: " in out and "target_model_type qwen2_5_vl vs the target's llava" in out


# ---------------- a batch job checks its drafter on the driver ----------------

def job_heads(llava, root: Path) -> dict[str, tuple[Path, list[str]]]:
    """name -> (a drafter the tiny LLaVA checkpoint cannot run, what the job's one error line names)."""
    write_eagle3(root / "vocab", llava, "specforge", vd=100)
    edit(root / "vocab", vocab_size=301)
    Eagle2Drafter.random(llava).head.save(root / "own")
    edit(root / "own", target_vocab_size=301)
    write_eagle1(root / "trunc", llava)
    truncate(root / "trunc" / "pytorch_model.bin")
    write_eagle3(root / "fam", llava, "specforge", vd=100)
    edit(root / "fam", target_model_type="qwen2_5_vl")
    return {"released for another vocabulary": (root / "vocab", ["vocabulary 301 vs the target's 300"]),
            "own for another vocabulary": (root / "own", ["trained for another target", "301"]),
            "truncated weights": (root / "trunc", ["pytorch_model.bin cannot be read", "truncated"]),
            "another family": (root / "fam", ["target_model_type qwen2_5_vl"])}


@pytest.mark.parametrize("case", ["released for another vocabulary", "own for another vocabulary",
                                  "truncated weights", "another family"])
def test_a_batch_job_refuses_its_drafter_before_ray_or_any_write(llava, ckpt, tmp_path, capsys, case):
    """Through the job CLI: exit 2, one line naming the drafter, nothing written (no output, no marker), no Ray."""
    import ray

    path, named = job_heads(llava, tmp_path / "heads")[case]
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": ["a"], "prompt": ["p"], "image_uri": ["x.png"]}), src)
    out = tmp_path / "out"
    rc = job_main(["--input", str(src), "--output", str(out), "--target", ckpt, "--drafter", str(path)], "instruct")
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"error: drafter {path}") and all(n in err for n in named), err
    assert not out.exists() and not ray.is_initialized()


def test_generate_refuses_a_drafter_before_the_target_loads(llava, ckpt, tmp_path, capsys, monkeypatch):
    """`mmspec generate` checks a drafter directory against the target's config before the (minutes-long) load."""
    import mmspec_ray.targets

    path, named = job_heads(llava, tmp_path / "heads")["released for another vocabulary"]
    monkeypatch.setattr(mmspec_ray.targets, "load_target", lambda *a, **k: pytest.fail("the target was loaded"))
    rc = cli_main(["generate", "--target", ckpt, "--drafter", str(path), "--prompt", "hi"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and f"drafter {path}" in err and all(n in err for n in named), err


def test_an_own_drafters_weights_must_be_the_ones_its_config_describes(llava, tmp_path, capsys):
    """A config.json and model.safetensors of different drafters: refused without a target, naming both sides."""
    from mmspec_ray.drafters.eagle3 import Eagle3Drafter

    Eagle2Drafter.random(llava).head.save(tmp_path / "e2")
    Eagle3Drafter.random(llava).head.save(tmp_path / "e3")
    (tmp_path / "e2" / "model.safetensors").write_bytes((tmp_path / "e3" / "model.safetensors").read_bytes())
    assert cli_main(["drafter", "inspect", str(tmp_path / "e2")]) == 1
    out = capsys.readouterr().out.strip()
    assert out.startswith(f"refused: drafter {tmp_path / 'e2'}: model.safetensors ") and "shapes differ" in out, out
    refused(tmp_path / "e2", llava, "model.safetensors", "save the drafter again")


@pytest.mark.parametrize("family", ["llava", "qwen2_5_vl"])
def test_a_checkpoints_facts_from_its_config_are_the_loaded_targets(family, tmp_path):
    """The driver's check reads the target from its config and headers alone: the same facts as the loaded target,
    so a drafter that fits is never refused there."""
    from dataclasses import astuple

    from mmspec_ray.drafters.facts import facts_from_layout, facts_of
    from mmspec_ray.targets import load_target
    from mmspec_ray.targets.layout import read_layout

    model, processor = (tiny_llava if family == "llava" else tiny_qwen2_5_vl)()
    model.save_pretrained(tmp_path / "t")
    read = facts_from_layout(read_layout(str(tmp_path / "t")))
    if family == "llava":  # a checkpoint that loads with its processor: the identity too
        processor.save_pretrained(tmp_path / "t")
        loaded = facts_of(load_target(str(tmp_path / "t")))
        assert read.identity == loaded.identity is not None
    else:  # the tiny Qwen2.5-VL's processor does not round-trip here (test_targets_loading): the model in memory
        loaded = facts_of(wrap(model, processor))
    assert astuple(read)[1:7] == astuple(loaded)[1:7]
    assert bool(read.mrope_section) == (family == "qwen2_5_vl")


def test_serve_refuses_a_drafter_before_any_replica(llava, ckpt, tmp_path, monkeypatch):
    """The endpoint's app builder checks a drafter given by path as a batch job's driver does: one line naming the
    drafter, before any replica is asked for."""
    from mmspec_ray.batch.storage import JobInputError
    from mmspec_ray.serve import app as serve_app

    monkeypatch.setattr(serve_app, "refuse_open_cluster", lambda settings: None)
    monkeypatch.setattr(serve_app.ChatServer, "options", lambda **kw: pytest.fail("a replica was asked for"))
    for case, (path, named) in job_heads(llava, tmp_path / "heads").items():
        with pytest.raises(JobInputError) as e:
            serve_app.build_app({"decode": {"target": ckpt, "drafter": str(path), "device": "cpu"}})
        assert str(e.value).startswith(f"drafter {path}") and all(n in str(e.value) for n in named), (case, e.value)
        assert "\n" not in str(e.value)
