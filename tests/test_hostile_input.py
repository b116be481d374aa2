"""Hostile input: generated invalid configs and CLI arguments all end in one line and exit code 2.

Every case is built to be invalid (an unknown key, a value of the wrong type, a number out of
range, a bad fault spec, a missing path, a YAML tag that would construct a Python object, YAML
past its bounds: an alias bomb, a 1 MB file), so a case that starts training instead is itself a
failure. No case may print a traceback.
"""

import contextlib
import io
import re
import string
import time

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paraloom.cli import main
from paraloom.config import load_config
from paraloom.config.errors import UserError
from paraloom.config.help import section_keys
from paraloom.config.yaml_io import parse_overrides, parse_yaml

KEYS = {section: {key: (kind, default) for key, kind, default, _ in rows}
        for section, rows in section_keys().items()}
NAMES = st.text(string.ascii_lowercase + "_", min_size=1, max_size=12)
# keys that must be at least 1 / must not be negative / must lie in (0, 1] ...
AT_LEAST_ONE = [("run", "log_every"), ("run", "trace_steps"), ("run", "keep_checkpoints"),
                ("model", "hidden"), ("model", "depth"), ("model", "channels"), ("data", "batch_size"),
                ("data", "n_samples"), ("data", "n_features"), ("optim", "epochs"),
                ("parallel", "nproc"), ("comm", "local_steps"), ("guard", "max_bad_steps")]
NOT_NEGATIVE = [("run", "checkpoint_every"), ("run", "max_restarts"), ("optim", "momentum"),
                ("optim", "weight_decay"), ("comm", "local_warmup")]
POSITIVE_FLOAT = [("optim", "lr"), ("comm", "timeout_s"), ("comm", "bucket_mb"), ("comm", "credit_mb"),
                  ("comm", "first_bucket_mb"), ("comm", "partition_mb")]


@st.composite
def unknown_key(draw):
    section = draw(st.sampled_from(sorted(KEYS)))
    key = draw(NAMES.filter(lambda k: k not in KEYS[section]))
    return ["--set", f"{section}.{key}=1"]


@st.composite
def unknown_section(draw):
    section = draw(NAMES.filter(lambda s: s not in KEYS))
    return ["--set", f"{section}.x=1"]


@st.composite
def wrong_type(draw):
    """A word where a number or a boolean belongs, or a word outside a key's choices."""
    section = draw(st.sampled_from(sorted(KEYS)))
    key = draw(st.sampled_from(sorted(KEYS[section])))
    kind, _ = KEYS[section][key]
    word = draw(st.text(string.ascii_letters, min_size=2, max_size=10)
                .filter(lambda w: w.lower() not in {"true", "false", "yes", "no", "on", "off",
                                                    "null", "none", "nan", "inf", "infinity", "y", "n"}))
    if "|" in kind:  # a choice: any word that is not one
        if word in kind.split("|"):
            word += "_x"
    elif "str" in kind:  # free text (run.name, run.out_dir, comm.interface, run.inject)
        if key == "inject":
            return ["--set", f"run.inject={word}"]  # no ':' -> never a valid fault
        return ["--set", f"{section}.{key}=[{word}]"]  # a list is never a single value
    return ["--set", f"{section}.{key}={word}"]


@st.composite
def out_of_range(draw):
    which = draw(st.sampled_from(["one", "neg", "float"]))
    if which == "one":
        section, key = draw(st.sampled_from(AT_LEAST_ONE))
        value = draw(st.integers(-10**6, 0))
    elif which == "neg":
        section, key = draw(st.sampled_from(NOT_NEGATIVE))
        value = draw(st.integers(-10**6, -1))
    else:
        section, key = draw(st.sampled_from(POSITIVE_FLOAT))
        value = draw(st.floats(-1e6, 0.0, allow_nan=False))
    return ["--set", f"{section}.{key}={value}"]


@st.composite
def bad_fault(draw):
    kind = draw(st.sampled_from(["kill", "hang", "nan", "slow", "boom"]))
    rank = draw(st.sampled_from(["-1", "x", "2", "99", "random"]))
    tail = draw(st.sampled_from(["step=0", "step=-3", "step=100000", "factor=0.1", "", "step=abc"]))
    # no combination is valid: 2 ranks (0, 1) run by default, and no tail is a valid step or factor
    spec = f"{kind}:rank={rank}" + (f",{tail}" if tail else "")
    return ["--inject", spec]


@st.composite
def bad_option(draw):
    choice = draw(st.integers(0, 5))
    if choice == 0:
        return ["--nproc", str(draw(st.integers(-100, 0)))]
    if choice == 1:
        return ["--resume", "/nonexistent/" + draw(NAMES)]
    if choice == 2:
        return ["/nonexistent/" + draw(NAMES) + ".yaml"]
    if choice == 3:
        return ["--" + draw(NAMES.filter(lambda n: n not in {"set", "nproc", "trace", "resume", "inject",
                                                              "cluster", "emulate", "help"}))]
    if choice == 4:
        return ["--set", draw(st.text(string.ascii_lowercase + ".", min_size=1, max_size=10))]
    return ["--emulate", draw(st.sampled_from(["4", "x1gbit", "0x1gbit", "4x", "4xfast", "-2x1gbit"]))]


CASES = st.one_of(unknown_key(), unknown_section(), wrong_type(), out_of_range(), bad_fault(), bad_option())


def _run(argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["train", *argv])
    return code, err.getvalue()


@settings(max_examples=200, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(CASES)
def test_invalid_input_is_one_line_and_exit_2(argv):
    code, err = _run(argv)
    assert code == 2, (argv, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("paraloom: error: "), (argv, err)
    assert "Traceback" not in err


def test_yaml_that_constructs_python_objects_is_refused(tmp_path):
    for tag in ("!!python/object/apply:os.system ['echo pwned']", "!!python/name:os.system",
                "!!python/object/new:builtins.dict {}"):
        path = tmp_path / "evil.yaml"
        path.write_text(f"run:\n  name: {tag}\n")
        code, err = _run([str(path)])
        assert code == 2 and err.startswith("paraloom: error: ") and "not valid YAML" in err, err


@pytest.mark.parametrize("name", ["x" * 101, "x" * 300, "two\nlines", ".hidden", "-rf", "a b", "a/b", "..",
                                  "naïve", "tab\t", ""])
def test_a_run_name_that_is_no_plain_directory_name_is_refused(name, tmp_path, monkeypatch):
    """Before anything is made: 300 characters once gave a traceback (File name too long), a newline a
    folder named with it."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({"run": {"name": name}}))
    for argv in (["c.yaml"], ["--set", f"run.name={name}"])[:2 if name else 1]:  # `run.name=`: no name
        code, err = _run(argv)
        assert code == 2, (argv, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("paraloom: error: run.name="), (argv, err)
        if name.strip() and "\n" not in name:  # --set reads the value as YAML: these are no name
            assert "1 to 100 letters (a-z, A-Z), digits, '.', '_' or '-'" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml"]


def test_a_run_name_of_100_plain_characters_is_taken():
    from paraloom.config import load_config

    for name in ("a" * 100, "run_1.2-b", "_x", "9a"):
        assert load_config(None, [f"run.name={name}"]).run.name == name


@pytest.mark.parametrize("argv", [
    "bench collectives --sizes abc", "bench collectives --nproc 1", "bench collectives --algorithms nope",
    "bench collectives --json /nonexistent/x.json", "bench collectives --max-repeats 1",
    "bench collectives --dtype float64",
    "cluster up --nodes 0", "cluster up --nodes -3", "cluster up --bandwidth fast", "cluster up --name BAD!",
    "cluster up --latency 5ms", "report /nonexistent", "report /", "train --resume /",
    "train --resume / extra.yaml", "train --cluster a --emulate 2x1gbit",
])
def test_every_command_refuses_bad_arguments_in_one_line(argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(argv.split())
    assert code == 2, err.getvalue()
    lines = err.getvalue().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("paraloom: error: ") and "Traceback" not in err.getvalue()


def _laughs(levels, width=9):
    """A "billion laughs" under model.options: each of `levels` lists holds `width` aliases of the one
    before, so the last expands to `width ** levels` values (9 levels: 387 million)."""
    lists = [f"    l0: &l0 [{', '.join(['lol'] * width)}]"]
    lists += [f"    l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]" for i in range(1, levels)]
    return "model:\n  options:\n" + "\n".join(lists) + "\n"


BOUNDED = {  # config file text, what the one line says
    "alias bomb": (_laughs(9), "holds more than 10,000 values, aliases expanded"),
    "a value holding itself": ("model:\n  options:\n    a: &a [1, *a]\n", "alias *a inside the value"),
    "deep": ("model:\n  options:\n    a: " + "[" * 150 + "]" * 150 + "\n", "nests deeper than 100 levels"),
    "over 1 MB": ("run:\n  name: big\n" + "# padding\n" * 110_000, "is over 1,048,576 bytes"),
}


@pytest.mark.parametrize("case", list(BOUNDED))
def test_config_beyond_its_bounds_is_refused_in_a_second_before_a_run_directory(case, tmp_path):
    text, says = BOUNDED[case]
    path = tmp_path / "config.yaml"
    path.write_text(text)
    started = time.perf_counter()
    with pytest.raises(UserError, match=re.escape(says)):
        load_config(path)
    assert time.perf_counter() - started < 1, case
    out = tmp_path / "runs"
    code, err = _run([str(path), "--set", f"run.out_dir={out}"])
    assert code == 2 and err.count("\n") == 1 and says in err and str(path) in err, err
    assert not out.exists()


def test_a_set_value_is_bounded_as_a_config_file_is(tmp_path):
    bomb = "[" + ", ".join(f"&l{i} [{', '.join([f'*l{i - 1}' if i else 'lol'] * 9)}]" for i in range(9)) + "]"
    started = time.perf_counter()
    with pytest.raises(UserError, match="holds more than 10,000 values"):
        parse_overrides([f"model.options.x={bomb}"])
    assert time.perf_counter() - started < 1
    code, err = _run(["--set", f"model.options.x={bomb}", "--set", f"run.out_dir={tmp_path / 'runs'}"])
    assert code == 2 and err.count("\n") == 1 and "--set model.options.x= holds more than 10,000" in err, err
    assert not (tmp_path / "runs").exists()
    # within the bounds, aliases read as before
    assert parse_yaml("a: &a [1, 2]\nb: *a\n", "config") == {"a": [1, 2], "b": [1, 2]}
