"""Config: YAML + dotted overrides, types checked, every mistake a UserError naming key and fix."""

import pytest

from paraloom.config import CommConfig, Config, dump_config, load_config
from paraloom.config.errors import UserError
from paraloom.config.yaml_io import parse_overrides, read_yaml


def test_defaults_are_the_main_job():
    cfg = load_config()
    assert (cfg.model.name, cfg.data.name, cfg.parallel.mode, cfg.parallel.nproc) == \
        ("cnn", "digits", "dp", 2)


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  batch_size: 32\noptim:\n  name: sgd\n  lr: 0.1\n")
    cfg = load_config(path, ["optim.lr=1e-3", "run.name=x", "optim.max_steps=null"])
    assert cfg.data.batch_size == 32 and cfg.optim.name == "sgd"
    assert cfg.optim.lr == pytest.approx(1e-3) and cfg.run.name == "x" and cfg.optim.max_steps is None


def test_round_trip_through_yaml(tmp_path):
    cfg = load_config(None, ["model.name=mlp", "comm.interface=eth0", "optim.epochs=3"])
    dump_config(cfg, tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.yaml") == cfg
    assert Config.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(("overrides", "message"), [
    (["data.name=nope"], r"data.name='nope' is not valid; choose one of: digits, synthetic"),
    (["nope.key=1"], r"unknown section 'nope'.*sections: run, model, data"),
    (["data.size=1"], r"unknown key data.size; keys of data: name, batch_size"),
    (["data.batch_size=abc"], r"data.batch_size must be int, got 'abc'"),
    (["data.batch_size=1.5"], r"data.batch_size must be int"),
    (["data.batch_size=0"], r"data.batch_size=0 must be at least 1"),
    (["run.tensorboard=1"], r"run.tensorboard must be bool"),
    (["optim.lr=-1"], r"optim.lr=-1.0 must be positive"),
    (["optim.lr=.nan"], r"optim.lr must be a finite number"),
    (["optim.lr=null"], r"optim.lr must not be empty"),
    (["data.test_fraction=1"], r"data.test_fraction=1.0 must lie strictly between 0 and 1"),
    (["parallel.nproc=0"], r"parallel.nproc=0 must be at least 1"),
    (["batch_size=3"], r"must look like section.key=value"),
    (["data.batch_size"], r"must look like section.key=value"),
    (["data.batch_size=[1, 2]"], r"takes a single value"),
    (["run.name=a/b"], r"plain directory name"),
    (["comm.sync=async"], r"comm.sync='async' is not valid; choose one of: sync, one_step_delay, local_sgd"),
    (["comm.scheduler=priority", "comm.sync=one_step_delay"], r"priority works with comm.sync=sync"),
    (["comm.shard_optimizer=true", "comm.sync=local_sgd"], r"shard_optimizer=true works with comm.sync=sync"),
    (["comm.shard_optimizer=true", "comm.algorithm=tree"], r"reduce-scatters with algorithm native or ring"),
    (["comm.local_steps=0"], r"comm.local_steps must be at least 1"),
    (["comm.partition_mb=0"], r"partition_mb must be positive"),
    (["comm.timeout_s=1e300"], r"comm.timeout_s=1e\+300 must lie between 1 s and 604800 s \(7 days\)"),
    (["comm.timeout_s=1e-6"], r"comm.timeout_s=1e-06 must lie between 1 s and 604800 s"),
    (["run.seed=-1"], r"run.seed=-1 must lie between 0 and 2\*\*63-1 \(9223372036854775807\)"),
    (["run.seed=9223372036854775808"], r"run.seed=9223372036854775808 must lie between 0 and 2\*\*63-1"),
    (["comm.credit_mb=0"], r"comm.credit_mb=0.0 must be positive"),
    (["comm.compressor=zip"], r"comm.compressor='zip' is not valid; choose one of: none, fp16"),
    (["comm.density=0.1"], r"comm.density applies to compressors topk, randomk, dgc"),
    (["comm.compressor=topk", "comm.density=2"], r"comm.density=2.0 must lie in \(0, 1\]"),
    (["comm.compressor=qsgd", "comm.bits=3"], r"comm.bits=3 applies to comm.compressor=qsgd"),
    (["comm.compressor=topk", "comm.sync=one_step_delay"], r"not with one_step_delay"),
    (["comm.lowrank=2"], r"comm.lowrank=2 applies to comm.compressor=powersgd"),
    (["comm.compressor=powersgd", "comm.lowrank=0"], r"and must be at least 1"),
])
def test_bad_overrides_name_the_key(overrides, message):
    with pytest.raises(UserError, match=message):
        load_config(None, overrides)


@pytest.mark.parametrize(("text", "message"), [
    ("- 1\n- 2\n", "must be a mapping of sections, got list"),
    ("just text", "must be a mapping of sections, got str"),
    ("data: [1, 2]\n", "section 'data' .* must be a mapping"),
    ("data: {batch_size: 32\n", "is not valid YAML"),
    ("!!python/object/apply:os.system ['true']\n", "is not valid YAML"),
    ("run: !!python/name:os.system\n", "is not valid YAML"),
])
def test_bad_files(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(UserError, match=message):
        load_config(path)


def test_missing_directory_and_binary_files(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        read_yaml(tmp_path / "absent.yaml")
    with pytest.raises(UserError, match="is a directory"):
        read_yaml(tmp_path)
    (tmp_path / "b.yaml").write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(UserError, match="cannot read"):
        read_yaml(tmp_path / "b.yaml")
    (tmp_path / "empty.yaml").write_text("")
    assert load_config(tmp_path / "empty.yaml") == load_config()


def test_world_checks_suggest_a_batch_size():
    cfg = load_config(None, ["data.batch_size=63"])
    cfg.validate_world(2)  # data-parallel workers take near-equal shares, weighted
    with pytest.raises(UserError, match="gives some of the 64 workers no sample; choose at least 64"):
        cfg.validate_world(64)
    tp = load_config(None, ["data.batch_size=63", "model.name=gpt", "data.name=text", "parallel.tp=2"])
    with pytest.raises(UserError, match="cannot be split across 2 data-parallel replicas; .* e.g. 62 or 64"):
        tp.validate_world(4)
    tp.validate_world(6)
    with pytest.raises(UserError, match="model.name=cnn needs image data"):
        load_config(None, ["data.name=synthetic"]).validate_world(1)


def test_override_values_parse_as_yaml_scalars():
    assert parse_overrides(["a.b=true", "a.c=3", "a.d=x y", "a.e=", "a.f=2026-01-01"]) == \
        {"a": {"b": True, "c": 3, "d": "x y", "e": None, "f": "2026-01-01"}}


def test_compressor_options_come_from_the_keys_that_were_set():
    assert CommConfig(compressor="powersgd", lowrank=3).compressor_options() == {"rank": 3}
    assert CommConfig(compressor="topk", density=0.5).compressor_options() == {"density": 0.5}
    assert CommConfig(compressor="qsgd").compressor_options() == {}


GPT = ["model.name=gpt", "data.name=text"]


@pytest.mark.parametrize(("overrides", "world", "message"), [
    ([*GPT, "parallel.tp=3"], 3, r"parallel.tp=3 does not divide model.n_heads=4; choose tp in \{1, 2, 4\}"),
    (["parallel.tp=2"], 2, r"parallel.tp=2 needs a tensor-parallel plan; model.name=cnn has none"),
    (["model.name=gpt"], 1, r"model.name=gpt cannot train on data.name=digits"),
    (["model.name=mlp", "data.name=text"], 1, r"model.name=mlp cannot train on data.name=text"),
    ([*GPT, "parallel.pp=2", "parallel.microbatches=3"], 4,
     r"per-replica batch of 32 does not split into parallel.microbatches=3; .* multiple of 6"),
    ([*GPT, "parallel.tp=2", "parallel.pp=2"], 6,
     r"parallel.tp=2 x parallel.pp=2 does not divide 6 workers; .* multiple of 4"),
    ([*GPT, "parallel.pp=7"], 7, r"parallel.pp=7 stages exceed the gpt's 6 pieces"),
    ([*GPT, "parallel.pp=4", "parallel.microbatches=4", "parallel.schedule=interleaved_1f1b",
      "parallel.virtual_stages=2"], 4,
     r"parallel.pp=4 x parallel.virtual_stages=2 stages exceed the gpt's 6"),
    ([*GPT, "parallel.pp=2", "comm.sync=local_sgd"], 2, r"run with comm.sync=sync"),
    ([*GPT, "parallel.pp=2", "comm.scheduler=priority", "comm.compressor=powersgd"], 4,
     r"powersgd under comm.scheduler=priority needs a whole-world"),
])
def test_model_parallel_world_checks(overrides, world, message):
    cfg = load_config(None, overrides)
    with pytest.raises(UserError, match=message):
        cfg.validate_world(world)


@pytest.mark.parametrize(("overrides", "message"), [
    (["parallel.mode=layers", "parallel.microbatches=2"], r"parallel.mode=layers has no micro-batches"),
    (["parallel.mode=layers", "parallel.tp=2"], r"parallel.mode=layers has no .* tensor parallelism"),
    (["parallel.mode=ps", "parallel.tp=2"], r"parallel.mode=ps trains whole replicas: leave parallel.tp"),
    (["parallel.mode=ps", "parallel.pp=2"], r"parallel.mode=ps trains whole replicas"),
    (["parallel.microbatches=0"], r"parallel.microbatches=0 must be at least 1"),
    ([*GPT, "parallel.pp=2", "run.resize_policy=per_rank_batch"],
     r"run.resize_policy=per_rank_batch applies to data-parallel runs; a resized model_parallel run keeps"),
    (["parallel.mode=ps", "run.resize_policy=per_rank_batch"], r"a resized parameter_server run keeps"),
    (["run.resize_policy=per_rank"], r"per_rank"),
])
def test_model_parallel_modes_refused(overrides, message):
    with pytest.raises(UserError, match=message):
        load_config(None, overrides)


def test_grids_of_model_parallel_runs():
    assert load_config(None, [*GPT, "parallel.tp=2", "parallel.pp=2"]).grid(8) == (2, 2, 2)
    assert load_config(None, ["parallel.mode=layers"]).grid(3) == (1, 1, 3)  # every rank a stage
    layers = load_config(None, ["parallel.mode=layers", "data.batch_size=64"])
    assert layers.parallel.model_parallel and not load_config().parallel.model_parallel
    layers.validate_world(3)  # one replica takes the whole batch
    load_config(None, [*GPT, "parallel.tp=4", "parallel.pp=2", "parallel.microbatches=4"]).validate_world(16)


@pytest.mark.parametrize(("overrides", "message"), [
    (["sparse.sparsity=1.0"], r"need 0 <= initial <= sparsity < 1"),
    (["sparse.sparsity=0.5", "sparse.initial=0.6"], r"need 0 <= initial <= sparsity < 1"),
    (["sparse.every=0"], r"sparse.every must be at least 1"),
    (["sparse.sparsity=0.9", "comm.compressor=fp16"], r"the masks are its compression"),
    (["sparse.sparsity=0.9", "parallel.mode=ps"], r"runs in data-parallel training"),
    (["sparse.sparsity=0.9", "comm.sync=local_sgd"], r"with comm.sync=sync"),
])
def test_sparse_settings_refused(overrides, message):
    with pytest.raises(UserError, match=message):
        load_config(None, overrides)


@pytest.mark.parametrize(("overrides", "message"), [
    (["parallel.virtual_stages=2"], r"parallel.virtual_stages=2 is for parallel.schedule=interleaved_1f1b"),
    ([*GPT, "parallel.pp=2", "parallel.microbatches=3", "parallel.schedule=interleaved_1f1b"],
     r"interleaved_1f1b runs micro-batches in groups of the 2 stages: parallel.microbatches=3 must be a "
     r"multiple of 2"),
    (["parallel.virtual_stages=0"], r"parallel.virtual_stages=0"),
])
def test_interleaving_is_checked_in_one_line(overrides, message):
    with pytest.raises(UserError, match=message):
        load_config(None, overrides)


def test_recompute_takes_its_three_modes_and_the_old_booleans():
    def model(*overrides):
        return load_config(None, ["model.name=gpt", "data.name=text", *overrides]).model

    assert model().recompute == "none" and model().attention == "sdpa"
    assert model("model.recompute=selective", "model.attention=math").recompute == "selective"
    assert model("model.recompute=true").recompute == "full"
    assert model("model.recompute=false").recompute == "none"
    with pytest.raises(UserError, match="model.recompute"):
        model("model.recompute=some")
    with pytest.raises(UserError, match="model.attention"):
        model("model.attention=flash")


def test_a_resume_on_another_strategy_puts_the_settings_it_does_not_use_back_to_their_defaults():
    from paraloom.config.sections import left_behind

    pipeline = {"parallel": {"pp": 2, "microbatches": 4, "schedule": "gpipe"}}
    assert left_behind(pipeline, ["parallel.pp=1"]) == ["parallel.microbatches=1", 'parallel.schedule="1f1b"']
    assert left_behind(pipeline, ["parallel.pp=1", "parallel.microbatches=1"]) == ['parallel.schedule="1f1b"']
    assert left_behind(pipeline, ["optim.epochs=3"]) == []  # the same strategy: nothing to put back
    assert left_behind({"parallel": {"mode": "ps"}, "ps": {"consistency": "ssp"}},
                       ["parallel.mode=dp"]) == ['ps.consistency="bsp"']
