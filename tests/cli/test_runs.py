"""jqlora.runs (run records, config files, finding a run's checkpoint) and jqlora._util, without
a model: the export itself is tested on a trained run in test_cli.py."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from jqlora import runs
from jqlora._util import fmt_bytes, jnp_dtype
from jqlora.errors import Error, SettingError
from jqlora.runs import RunError
from jqlora.train.config import TrainConfig


def test_load_config_file_json_toml_and_errors(tmp_path):
    j = tmp_path / "a.json"
    j.write_text(json.dumps({"model": "m", "lora": {"rank": 4}}))
    assert runs.load_config_file(j) == {"model": "m", "lora": {"rank": 4}}
    t = tmp_path / "a.TOML"  # the suffix picks the parser, in any case
    t.write_text('model = "m"\n[lora]\nrank = 4\n')
    assert runs.load_config_file(t) == {"model": "m", "lora": {"rank": 4}}
    cases = {"bad.json": ("{not json", "invalid JSON"), "bad.toml": ("model = ", "invalid TOML"),
             "list.json": ("[1, 2]", "top level must be an object/table, got list")}
    for name, (text, msg) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(RunError, match=msg) as e:
            runs.load_config_file(tmp_path / name)
        assert str(tmp_path / name) in str(e.value)
    with pytest.raises(RunError, match="cannot read config file") as e:
        runs.load_config_file(tmp_path / "missing.json")
    assert "missing.json" in str(e.value)
    assert issubclass(RunError, Error) and issubclass(RunError, ValueError)  # the CLI maps Error to exit status 2


def test_run_record_roundtrip_and_lookup(tmp_path):
    from jqlora.lora import LoraConfig

    for targets in (("q_proj", "v_proj"), r".*\.(q|v)_proj"):
        cfg = LoraConfig(rank=4, alpha=8.0, dropout=0.1, target_modules=targets, use_rslora=True)
        rec = runs.LoraSettings.from_config(cfg).to_record()
        assert json.loads(json.dumps(rec)) == rec  # JSON types only
        assert runs.RunSettings.from_record({"lora": rec}).lora.to_config() == cfg
    run_dir = tmp_path / "run"
    settings = runs.RunSettings(runs.ModelSettings(model="/m"), runs.LoraSettings.from_config(cfg),
                                TrainConfig(steps=3, out_dir=str(run_dir)))
    path = settings.write_record()
    assert path == run_dir / runs.RUN_FILE
    rec = runs.load_config_file(path)
    assert rec["format"] == runs.RUN_FORMAT and rec["version"] == runs.RUN_VERSION and rec["model"] == "/m"
    assert runs.RunSettings.read(path) == settings
    step = run_dir / "checkpoints" / "step_00000003"
    step.mkdir(parents=True)
    for d in (run_dir, run_dir / "checkpoints", step):  # the run dir, its checkpoints/ or one step
        assert runs.find_run_file(d) == path
    assert runs.find_run_file(tmp_path) is None


def _checkpoint(root, step):
    d = root / f"step_{step:08d}"
    d.mkdir(parents=True)
    (d / "state.json").write_text("{}")
    return d


def test_find_checkpoint(tmp_path):
    ck = tmp_path / "run" / "checkpoints"
    s2, s3 = _checkpoint(ck, 2), _checkpoint(ck, 3)
    (ck / "step_00000009").mkdir()  # incomplete: no state.json
    assert runs.find_checkpoint(tmp_path / "run") == s3  # newest
    assert runs.find_checkpoint(ck, 2) == s2
    assert runs.find_checkpoint(s2) == s2 and runs.find_checkpoint(s2, 2) == s2
    with pytest.raises(RunError, match=r"no checkpoint for step 9 \(have \[2, 3\]\)"):
        runs.find_checkpoint(ck, 9)
    with pytest.raises(RunError, match="single checkpoint; --step 3 does not name it"):
        runs.find_checkpoint(s2, 3)
    with pytest.raises(RunError, match="no training checkpoint found"):
        runs.find_checkpoint(tmp_path / "empty")


def test_export_adapter_input_errors(tmp_path):
    with pytest.raises(RunError, match="no such directory"):
        runs.export_adapter(tmp_path / "nope", tmp_path / "out")
    ck = _checkpoint(tmp_path / "run" / "checkpoints", 1)
    with pytest.raises(RunError, match="no jqlora_run.json found near"):
        runs.export_adapter(tmp_path / "run", tmp_path / "out")
    runs.RunSettings(lora=runs.LoraSettings(rank=4, alpha=8), train=TrainConfig(out_dir=str(tmp_path / "run"))).write_record()
    with pytest.raises(RunError, match="no 'model' recorded"):
        runs.export_adapter(ck, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_util_dtype_and_bytes():
    assert jnp_dtype("bfloat16").name == "bfloat16"
    with pytest.raises(ValueError, match="unknown dtype 'float8'; expected one of float32, bfloat16, float16"):
        jnp_dtype("float8")
    assert [fmt_bytes(n) for n in (0, 1023, 1536, 3 * 2**30, 2**50)] == [
        "0 B", "1023 B", "1.50 KiB", "3.00 GiB", "1024.00 TiB"]


# ------------------------------------------------------------------------------------ RunSettings
def _record(tmp_path, **train):
    """The stored settings of a run in tmp_path/run: rank 4 on q_proj and v_proj, epochs 2."""
    return runs.RunSettings(
        runs.ModelSettings(model=str(tmp_path / "m"), compute_dtype="float32", quantize="nf4"),
        runs.LoraSettings(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj")),
        TrainConfig(**{"out_dir": str(tmp_path / "run"), "seq_len": 100, "lr": 1e-3, "epochs": 2.0, "steps": 14,
                       **train}))


def test_layers_override_in_order_record_file_flags(tmp_path):
    rec = _record(tmp_path)
    file = {"seq_len": 200, "lora": {"dropout": 0.1}, "train": {"batch_size": 2}, "backend": "xla"}
    flags = {"seq_len": "300", "remat": "false", "adapter_out": "a"}
    s = runs.RunSettings.layered(rec, file, flags)
    assert s.train.seq_len == 300 and s.train.remat is False  # flags win
    assert s.train.batch_size == 2 and s.lora.dropout == 0.1 and s.model.backend == "xla"  # the file's
    assert s.train.lr == 1e-3 and s.lora.rank == 4 and s.model.quantize == "nf4"  # the record's
    assert s.output.adapter_out == "a" and s.adapter_dir == Path("a") and s.out_dir == tmp_path / "run"
    assert runs.RunSettings.layered(rec, file).train.seq_len == 200
    assert runs.RunSettings.layered(rec).train.seq_len == 100
    # over the CLI's defaults: attention and remat "auto" where no layer sets them
    bare = runs.RunSettings.layered(None, None, {"model": "m"})
    assert bare.model.attention == "auto" and bare.train.remat == "auto" and bare.train.seq_len == TrainConfig().seq_len
    assert bare.lora == runs.LoraSettings() and bare.lora_given == ()
    assert runs.RunSettings.layered(None, file, {"rank": 8}).lora_given == ("rank", "dropout")


def test_either_or_pairs(tmp_path):
    both = [({"epochs": "2", "steps": "5"}, "--epochs and --steps both given: --epochs sets steps"),
            ({"warmup": 2, "warmup_ratio": 0.1}, "--warmup-ratio and --warmup both given")]
    for flags, msg in both:
        with pytest.raises(RunError, match=msg):
            runs.RunSettings.layered(None, None, flags)
    with pytest.raises(RunError, match="epochs in c.json and steps in c.json both given"):
        runs.RunSettings.layered(None, {"train": {"epochs": 1, "steps": 4}}, file_name="c.json")
    assert runs.RunSettings.layered(None, None, {"epochs": "none", "steps": "5"}).train.steps == 5
    # across layers the later one wins
    s = runs.RunSettings.layered(None, {"epochs": 3, "warmup_ratio": 0.2}, {"steps": "11"})
    assert (s.train.epochs, s.train.steps, s.train.warmup_ratio) == (None, 11, 0.2)
    s = runs.RunSettings.layered(None, {"steps": 3, "warmup": 2}, {"epochs": "2", "warmup_ratio": "0.3"})
    assert (s.train.epochs, s.train.steps, s.train.warmup_ratio, s.train.warmup) == (2.0, 1000, 0.3, 0)
    # a record's steps were counted from its epochs: counted again, unless a later layer sets them
    rec = _record(tmp_path)
    assert runs.RunSettings.layered(rec).train.steps == TrainConfig().steps
    s = runs.RunSettings.layered(rec, None, {"steps": 30})
    assert (s.train.epochs, s.train.steps) == (None, 30)
    # a record given as the config file holds both: no error, its steps are dropped
    s = runs.RunSettings.layered(None, rec.to_record())
    assert (s.train.epochs, s.train.steps) == (2.0, TrainConfig().steps)


def test_record_round_trip(tmp_path):
    cases = [runs.RunSettings(),
             _record(tmp_path),
             runs.RunSettings(runs.ModelSettings(model="/m", compute_dtype="bfloat16", backend="xla", attention="cudnn",
                                                 quantize="int8", init_adapter="/a"),
                              runs.LoraSettings(rank=2, alpha=4, dropout=0.05, target_modules=r".*\.q_proj", use_rslora=True),
                              TrainConfig(remat="offload_layer_inputs", bos=None, eos=5, grad_clip=None),
                              runs.OutputSettings(adapter_out="/out"))]
    for s in cases:
        rec = s.to_record()
        assert json.loads(json.dumps(rec)) == rec
        assert runs.RunSettings.from_record(rec) == s
    # the record's keys, in the order the file has them
    assert list(cases[2].to_record()) == ["format", "version", "model", "compute_dtype", "backend", "attention",
                                          "quantize", "init_adapter", "adapter_out", "lora", "train"]
    assert "attention" not in cases[0].to_record() and "quantize" not in cases[0].to_record()
    with pytest.raises(RunError, match=r"r.json: unknown key 'extra'; expected model, compute_dtype"):
        runs.RunSettings.from_record({**cases[0].to_record(), "extra": 1}, "r.json")
    path = cases[1].write_record(skipped_batches=3)
    assert runs.load_config_file(path)["skipped_batches"] == 3 and runs.RunSettings.read(path) == cases[1]


def test_resume_keeps_the_model_and_lora_shape(tmp_path):
    rec = _record(tmp_path)
    where = tmp_path / "run"
    refused = {"rank": ({"rank": 8}, "--resume: lora.rank is 8 but the run in {} used 4"),
               "alpha": ({"alpha": 9.0}, "--resume: lora.alpha is 9.0 but the run in {} used 8.0"),
               "targets": ({"target_modules": "v_proj"},
                           "--resume: lora.target_modules is ('v_proj',) but the run in {} used ['q_proj', 'v_proj']"),
               "rslora": ({"use_rslora": True}, "--resume: lora.use_rslora is True but the run in {} used False"),
               "dtype": ({"compute_dtype": "bfloat16"},
                         "--resume: compute_dtype is 'bfloat16' but the run in {} used 'float32'"),
               "quantize": ({"quantize": "int8"}, "--resume: quantize is 'int8' but the run in {} used 'nf4'"),
               "model": ({"model": str(tmp_path / "other")},
                         f"--resume: model is '{tmp_path / 'other'}' but the run in {{}} used '{tmp_path / 'm'}'")}
    for name, (flags, msg) in refused.items():
        with pytest.raises(RunError) as e:
            runs.RunSettings.layered(rec, None, flags)
        assert str(e.value) == msg.format(where), name
    # the same settings in another spelling, and what may change, are taken
    (tmp_path / "m").mkdir()
    for flags in ({"target_modules": "v_proj,q_proj"}, {"alpha": 8}, {"rank": 4.0}, {"dropout": 0.2},
                  {"model": str(tmp_path / "run" / ".." / "m")}, {"steps": 50, "lr": "0.5"}):
        runs.RunSettings.layered(rec, None, flags)
    # a run on a regex keeps its regex (a record's string is what LoraConfig holds)
    regex = dataclasses.replace(rec, lora=dataclasses.replace(rec.lora, target_modules=r".*\.q_proj"))
    assert runs.RunSettings.layered(regex).lora.target_modules == r".*\.q_proj"
    assert runs.RunSettings.layered(regex, None, {"target_modules": r"re:.*\.q_proj"}).lora.target_modules == r".*\.q_proj"


def test_resolve_reads_the_record_only_when_resuming(tmp_path):
    rec = _record(tmp_path)
    rec.write_record()
    out = str(tmp_path / "run")
    assert runs.RunSettings.resolve(None, {"out_dir": out, "resume": True}).lora.rank == 4
    assert runs.RunSettings.resolve(None, {"out_dir": out}).lora.rank == 16
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'resume = true\nout_dir = "{out}"\n[lora]\ndropout = 0.5\n')
    s = runs.RunSettings.resolve(cfg, {})
    assert s.lora.rank == 4 and s.lora.dropout == 0.5 and s.lora_given == ("dropout",)
    assert runs.RunSettings.resolve(cfg, {"resume": False}).lora.rank == 16


def test_flags_parse_by_the_type_hints():
    layered = lambda **flags: runs.RunSettings.layered(None, None, flags).train  # noqa: E731
    t = layered(seq_len="16", lr="1e-3", grad_clip="none", epochs="1.5", remat="true", bos="none", eos="5",
                mesh="None", keep_checkpoints="null", chat_template="t.jinja")
    assert (t.seq_len, t.lr, t.grad_clip, t.epochs, t.remat, t.bos, t.eos, t.mesh, t.keep_checkpoints) == (
        16, 1e-3, None, 1.5, True, None, 5, None, None)
    t = layered(remat="offload_layer_inputs", bos="true", eos="</s>", out_dir="none", packing=False)
    assert (t.remat, t.bos, t.eos, t.out_dir, t.packing) == ("offload_layer_inputs", True, "</s>", "none", False)
    for flag, text, typ in (("seq_len", "abc", "int"), ("seq_len", "none", "int"), ("epochs", "x", "float | None"),
                            ("keep_checkpoints", "x", "int | None"), ("lr", "x", "float")):
        with pytest.raises(RunError, match=f"^--{flag.replace('_', '-')}: cannot parse '{text}' as {typ}$"):
            layered(**{flag: text})
    assert runs.type_name(runs.train_field_types()["bos"]) == "Any"
    assert runs.is_switch(runs.train_field_types()["progress"]) and not runs.is_switch(runs.train_field_types()["remat"])
    s = runs.RunSettings.layered(None, None, {"target_modules": "re:.*q_proj"})
    assert s.lora.target_modules == ".*q_proj"  # a regex, not a module named ".*q_proj"
    assert runs.RunSettings.layered(None, None, {"target_modules": "q_proj, v_proj,"}).lora.target_modules == (
        "q_proj", "v_proj")


def test_flag_choices_are_the_library_s():
    from jqlora import _util, ops
    from jqlora.cli.train_cmd import _CHOICES
    from jqlora.models.build import _Source
    from jqlora.train.config import LR_SCHEDULES

    assert _util.BACKENDS == ops.BACKENDS and _CHOICES["lr_schedule"] is LR_SCHEDULES
    for q in _util.QUANTIZE_FORMATS + (None,):
        _Source({}, quantize=q)
    # a config file's value reaches the loader: one line, exit 2
    with pytest.raises(SettingError, match="quantize must be None, 'nf4', 'fp4' or 'int8', got 'int4'"):
        _Source({}, quantize="int4")
    with pytest.raises(SettingError, match="unknown dtype 'float8'; expected one of float32, bfloat16, float16"):
        jnp_dtype("float8")


def test_cli_maps_library_errors_to_status_2_and_bugs_to_a_traceback(monkeypatch, capsys):
    """An `Error` (any library error class, CLIError) or a missing file is one line and exit 2; any
    other exception, a bare ValueError or KeyError included, is a bug: traceback, exit 1."""
    from jqlora.cli import _common, train_cmd
    from jqlora.cli import main
    from jqlora.train.examples import DataError

    def raising(exc):
        def run(args):
            raise exc
        return run

    for exc in (RunError("bad run"), DataError("bad run"), _common.CLIError("bad run"), FileNotFoundError("bad run")):
        monkeypatch.setattr(train_cmd, "run", raising(exc))
        assert main(["train"]) == 2, exc
        assert capsys.readouterr().err == "jqlora train: error: bad run\n"
    for exc in (ValueError("a bug"), KeyError("a bug"), TypeError("a bug")):
        monkeypatch.setattr(train_cmd, "run", raising(exc))
        assert main(["train"]) == 1, exc
        err = capsys.readouterr().err
        assert "Traceback" in err and "a bug" in err
    for cls in (RunError, DataError, _common.CLIError):
        assert issubclass(cls, Error)
