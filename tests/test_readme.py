"""README's commands stay true: every key it sets exists, every `paraloom train` command it shows
builds its config and passes the checks the launcher runs before any worker starts, and every other
`paraloom` command it shows parses (its subcommands, options and their values' types)."""

import dataclasses
import re
import shlex
from pathlib import Path

import pytest

from paraloom.config import Config, load_config
from paraloom.preflight import preflight

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
SECTIONS = [f.name for f in dataclasses.fields(Config)]
KEYS = {f"{section}.{key.name}" for section in SECTIONS
        for key in dataclasses.fields(getattr(Config(), section))}
OPTIONS = {"model.options", "data.options", "optim.options"}  # dicts: any key under them is the factory's
SKIPPED = re.compile(r"[<\[]|--help|--resume|--cluster")  # placeholders, or a run or cluster of the reader's


def train_commands(text: str) -> list[str]:
    """The `paraloom train` and `-m paraloom.worker` lines of the fenced blocks, continuations joined and
    comments dropped."""
    lines = []
    for block in re.findall(r"^```[a-z]*\n(.*?)^```", text, flags=re.S | re.M):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = " ".join(re.sub(r"\s+#.*$", "", line).split())
            if re.search(r"(^|\s)(paraloom train|-m paraloom\.worker)(\s|$)", line):
                lines.append(line)
    return lines


def parse(line: str) -> tuple[str | None, list[str], int | None, int]:
    """(config file, overrides as the CLI adds them, workers per node, nodes) of one command."""
    words = shlex.split(line)
    start = words.index("train") + 1 if "train" in words else words.index("paraloom.worker") + 1
    torchrun = dict(zip(words[:start], words[1:start], strict=False))  # each word and the one after it
    nodes = int(torchrun.get("--nnodes", "1").split(":")[0])
    per_node = int(torchrun["--nproc-per-node"]) if "--nproc-per-node" in torchrun else None
    config, sets, args = None, [], words[start:]
    while args:
        arg = args.pop(0)
        if arg == "--set":
            sets.append(args.pop(0))
        elif arg == "--nproc":
            per_node = int(args.pop(0))
        elif arg == "--emulate":
            nodes, per_node = int(args.pop(0).split("x")[0]), per_node or 1
        elif arg == "--trace":
            sets.append("run.trace=true")
        elif arg == "--inject":
            sets.append(f"run.inject={args.pop(0)}")
        elif not arg.startswith("-") and config is None:
            config = arg
        else:
            raise AssertionError(f"README command {line!r}: {arg!r} is no option of paraloom train")
    if per_node is not None:
        sets.append(f"parallel.nproc={per_node}")
    return config, sets, per_node, nodes


def test_every_key_the_readme_sets_exists():
    sections = "|".join(SECTIONS)
    assigned = set(re.findall(rf"(?<![\w./-])((?:{sections})\.[a-z_][a-z_0-9.]*)=", README))
    assert len(assigned) > 30  # the pattern still finds them
    unknown = sorted(key for key in assigned
                     if key not in KEYS and ".".join(key.split(".")[:2]) not in OPTIONS)
    assert not unknown, f"README sets keys the config does not have: {unknown}"


COMMANDS = [line for line in train_commands(README) if not SKIPPED.search(line)]


def test_the_readme_shows_train_commands():
    assert len(COMMANDS) >= 20, COMMANDS


@pytest.mark.parametrize("line", COMMANDS, ids=[line.replace("paraloom train ", "") for line in COMMANDS])
def test_a_readme_train_command_passes_the_launchers_checks(line, monkeypatch):
    config, sets, per_node, nodes = parse(line)
    if config is not None and not (ROOT / config).exists():
        pytest.skip(f"{config} is the reader's own file")  # `paraloom plan --emit best.yaml`'s output
    if line.startswith("PYTHONPATH=examples"):
        monkeypatch.syspath_prepend(str(ROOT / "examples"))
    monkeypatch.chdir(ROOT)
    cfg = load_config(config, sets)
    world = cfg.parallel.nproc * nodes
    if nodes > 1 and cfg.parallel.mode == "ps" and "--emulate" in line:
        world -= cfg.ps.servers  # on a cluster the servers take nodes of their own
    cfg.validate_world(world)
    preflight(cfg, world)


def other_commands(text: str) -> list[list[str]]:
    """Every `paraloom` command of the fenced blocks but `train`, as argument lists: a placeholder
    `<...>` stands for a word, and each alternative of an optional `[a | b]` is a command of its own
    (besides the one without it)."""
    out = []
    for block in re.findall(r"^```[a-z]*\n(.*?)^```", text, flags=re.S | re.M):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = " ".join(re.sub(r"\s+#.*$", "", line).split())
            if not re.match(r"^paraloom (?!train\b)\w", line):
                continue
            line = re.sub(r"<[^>]*>", "x", line)
            optional = re.findall(r"\[([^\]]*)\]", line)
            base = shlex.split(re.sub(r"\s*\[[^\]]*\]", "", line))[1:]
            out.append(base)
            out += [base + shlex.split(choice) for group in optional for choice in group.split("|")]
    return out


OTHERS = other_commands(README)


def test_the_readme_shows_other_commands():
    assert {args[0] for args in OTHERS} >= {"plan", "calibrate", "history", "report", "cluster", "bench"}


@pytest.mark.parametrize("args", OTHERS, ids=[" ".join(args)[:80] for args in OTHERS])
def test_a_readme_command_parses(args):
    """Parsed as the CLI parses it, down to its subcommand (nothing runs): an option README shows
    that the command does not have, or a value of the wrong type, fails here."""
    import typer

    from paraloom.cli import app

    command, name, rest = typer.main.get_command(app), "paraloom", list(args)
    ctx = None
    while True:
        ctx = command.make_context(name, rest, parent=ctx)
        if not hasattr(command, "resolve_command"):
            return
        # a group keeps its subcommand's name apart (click 8.2 made that attribute private)
        named = getattr(ctx, "_protected_args", None) or getattr(ctx, "protected_args", [])
        name, command, rest = command.resolve_command(ctx, [*named, *ctx.args])
