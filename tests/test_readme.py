"""README's and the documentation site's commands stay true: every key a page sets exists, every
`paraloom train` and `torchrun ... -m paraloom.run.worker` command it shows builds its config and passes
the checks the launcher runs before any worker starts, and every other `paraloom` command it shows
parses (its subcommands, options and their values' types)."""

import dataclasses
import re
import shlex
from pathlib import Path

import pytest

from paraloom.config import Config, load_config
from paraloom.run.preflight import preflight

ROOT = Path(__file__).resolve().parents[1]
PAGES = {path.relative_to(ROOT).as_posix(): path.read_text()
         for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]}
SECTIONS = [f.name for f in dataclasses.fields(Config)]
KEYS = {f"{section}.{key.name}" for section in SECTIONS
        for key in dataclasses.fields(getattr(Config(), section))}
OPTIONS = {"model.options", "data.options", "optim.options"}  # dicts: any key under them is the factory's
SKIPPED = re.compile(r"[<\[]|--help|--resume|--cluster")  # placeholders, or a run or cluster of the reader's
TRAIN_OPTIONS = {"--set", "--nproc", "--emulate", "--trace", "--inject"}  # `paraloom train`'s, less SKIPPED
WORKER_OPTIONS = {"--set", "--run-dir"}  # `python -m paraloom.run.worker`'s


def blocks(text: str) -> list[str]:
    """The fenced code blocks of a page (indented ones, inside list items, included)."""
    return re.findall(r"^[ \t]*```[a-z]*\n(.*?)^[ \t]*```", text, flags=re.S | re.M)


def lines(block: str) -> list[str]:
    """A block's lines, continuations joined, comments dropped, and the variables a Slurm script's
    `#SBATCH` lines settle given their values (`$SLURM_NNODES` of `#SBATCH --nodes=2` is 2)."""
    nodes = re.search(r"^#SBATCH --nodes=(\d+)", block, flags=re.M)
    values = {"SLURM_NNODES": nodes.group(1)} if nodes else {}
    out = []
    for line in re.sub(r"\\\n\s*", " ", block).splitlines():
        line = " ".join(re.sub(r"\s+#.*$", "", line).split())
        out.append(re.sub(r"\$\{?(\w+)\}?", lambda m: values.get(m.group(1), m.group(0)), line))
    return out


def train_commands(text: str) -> list[str]:
    """The `paraloom train` and `-m paraloom.run.worker` lines of a page's fenced blocks."""
    return [line for block in blocks(text) for line in lines(block)
            if re.search(r"(^|\s)(paraloom train|-m paraloom\.run\.worker)(\s|$)", line)]


def parse(line: str) -> tuple[str | None, list[str], int | None, int]:
    """(config file, overrides as the CLI adds them, workers per node, nodes) of one command."""
    words = shlex.split(line)
    worker = "paraloom.run.worker" in words
    start = words.index("paraloom.run.worker") + 1 if worker else words.index("train") + 1
    torchrun = dict(zip(words[:start], words[1:start], strict=False))  # each word and the one after it
    nodes = int(torchrun.get("--nnodes", "1").split(":")[0])
    per_node = int(torchrun["--nproc-per-node"]) if "--nproc-per-node" in torchrun else None
    config, sets, args = None, [], words[start:]
    known = WORKER_OPTIONS if worker else TRAIN_OPTIONS
    while args:
        arg = args.pop(0)
        if arg.startswith("-") and arg not in known:
            raise AssertionError(f"command {line!r}: {arg!r} is no option of "
                                 f"{'python -m paraloom.run.worker' if worker else 'paraloom train'}")
        if arg == "--set":
            sets.append(args.pop(0))
        elif arg == "--run-dir":
            args.pop(0)
        elif arg == "--nproc":
            per_node = int(args.pop(0))
        elif arg == "--emulate":
            nodes, per_node = int(args.pop(0).split("x")[0]), per_node or 1
        elif arg == "--trace":
            sets.append("run.trace=true")
        elif arg == "--inject":
            sets.append(f"run.inject={args.pop(0)}")
        elif config is None:
            config = arg
        else:
            raise AssertionError(f"command {line!r}: a second config file {arg!r}")
    if per_node is not None:
        sets.append(f"parallel.nproc={per_node}")
    return config, sets, per_node, nodes


def test_the_pages_are_found():
    assert "README.md" in PAGES and "docs/guide/torchrun.md" in PAGES and len(PAGES) > 15, sorted(PAGES)


@pytest.mark.parametrize("page", PAGES)
def test_every_key_a_page_sets_exists(page):
    sections = "|".join(SECTIONS)
    assigned = set(re.findall(rf"(?<![\w./-])((?:{sections})\.[a-z_][a-z_0-9.]*)=", PAGES[page]))
    unknown = sorted(key for key in assigned
                     if key not in KEYS and ".".join(key.split(".")[:2]) not in OPTIONS)
    assert not unknown, f"{page} sets keys the config does not have: {unknown}"


def test_the_pattern_still_finds_keys():
    sections = "|".join(SECTIONS)
    assigned = {key for text in PAGES.values()
                for key in re.findall(rf"(?<![\w./-])((?:{sections})\.[a-z_][a-z_0-9.]*)=", text)}
    assert len(assigned) > 30


COMMANDS = [(page, line) for page, text in PAGES.items()
            for line in train_commands(text) if not SKIPPED.search(line)]


def test_the_pages_show_train_commands():
    assert len(COMMANDS) >= 40, COMMANDS
    assert sum(page == "README.md" for page, _ in COMMANDS) >= 5
    assert sum("paraloom.run.worker" in line for _, line in COMMANDS) >= 4  # README, guide, Slurm, k8s


def short(page: str, line: str) -> str:
    """A test id: the page, and the command without `paraloom train` or torchrun's rendezvous options."""
    line = line.replace("paraloom train ", "")
    line = re.sub(r"(torchrun) .*?(?=-m paraloom\.run\.worker)", r"\1 ... ", line)
    return f"{page.removeprefix('docs/')}: {line}"[:160]


@pytest.mark.parametrize(("page", "line"), COMMANDS, ids=[short(*command) for command in COMMANDS])
def test_a_train_command_passes_the_launchers_checks(page, line, monkeypatch):
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
    """Every `paraloom` command of a page's fenced blocks but `train`, as argument lists: a
    placeholder `<...>` stands for a word, and each alternative of an optional `[a | b]` is a
    command of its own (besides the one without it)."""
    out = []
    for block in blocks(text):
        for line in lines(block):
            if not re.match(r"^paraloom (?!train\b)\w", line):
                continue
            line = re.sub(r"<[^>]*>", "x", line)
            optional = re.findall(r"\[([^\]]*)\]", line)
            base = shlex.split(re.sub(r"\s*\[[^\]]*\]", "", line))[1:]
            out.append(base)
            out += [base + shlex.split(choice) for group in optional for choice in group.split("|")]
    return out


OTHERS = [(page, args) for page, text in PAGES.items() for args in other_commands(text)]


def test_the_pages_show_other_commands():
    assert {args[0] for _, args in OTHERS} >= {"plan", "calibrate", "history", "report", "cluster", "bench"}
    assert any(page == "README.md" for page, _ in OTHERS)


@pytest.mark.parametrize(("page", "args"), OTHERS,
                         ids=[short(page, " ".join(args)) for page, args in OTHERS])
def test_a_command_parses(page, args):
    """Parsed as the CLI parses it, down to its subcommand (nothing runs): an option a page shows
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
