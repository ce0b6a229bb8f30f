"""What the docs name exists (issue 51): every environment variable (SGLANG_..., HICACHE_...),
metric (sglang:hicache_...), command of ours with its subcommand and flags, flag quoted on
its own and script (scripts/*.sh) that README.md and docs/*.md name is one the code has;
README's list of hooked SGLang methods is what register() registers, its list of relied-on
methods the guard's other targets, its metrics table every series the plugin exports.
Negative controls: a doc naming a bogus variable, metric, subcommand, flag or script, and
a README whose hook list lost or gained a row, fail.

Where a name is checked: variables against hicache_async_ack.env, SGLang's Envs and the
string literals of SGLang's, the plugin's, the lab's sources and the scripts; metrics
against metrics.SERIES / FAMILIES / PATH_INFO (and SGLang's own sources); commands
against the argparse parsers (the runtime's through its --help, the lab's objects);
flags of a command against that command's parser (and launch_server's where it passes
arguments on).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Optional

import pytest

from hicache_async_ack import env as plugin_env
from hicache_async_ack.guard import TARGETS
from hicache_async_ack.metrics import FAMILIES, PATH_INFO, SERIES
from hicache_async_ack.sglang_plugin import Environment, hooked_for, register
from hicache_async_ack.tools import main as runtime_main
from hicache_async_ack_lab import releases as lab_releases
from hicache_async_ack_lab.bench import step_profile
from hicache_async_ack_lab.cli import build_parser as lab_parser

ROOT = Path(__file__).resolve().parents[2]
# Historical records may name what no longer exists, each exempt for its reason.
EXEMPT = {
    "docs/bench-history.md": "the dated run-by-run record: it quotes each run's command, "
    "flags and output as they were then, retired ones included",
}
DOCS = sorted(
    p
    for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    if p.relative_to(ROOT).as_posix() not in EXEMPT
)

ENV_RE = re.compile(r"(?<![A-Za-z0-9_])(?:SGLANG|HICACHE)_[A-Z0-9_]*[A-Z0-9](?![A-Za-z0-9_*])")
METRIC_RE = re.compile(r"(?<![\w:])sglang[:_]hicache_[a-z0-9_]*[a-z0-9]")
SCRIPT_RE = re.compile(r"(?<![\w/.-])scripts/[\w.-]+\.sh")
FLAG_RE = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
# Where a command's own arguments end in a shell line.
END_RE = re.compile(r"\s#|\||;|&&|\s>|\$\(|`")
SEPARATOR_RE = re.compile(r"\s--(?:\s|$)")


# ------------------------------------------------------------------ what exists
@dataclass(frozen=True)
class Command:
    """A command line of ours: its subcommands' flags, whether each takes abbreviations
    and passes unknown arguments to launch_server, and what follows its ``--``."""

    subs: dict[str, frozenset[str]]
    abbrev: frozenset[str] = frozenset()
    passthrough: frozenset[str] = frozenset()
    after_separator: frozenset[str] = frozenset()  # subcommands whose `--` starts a launch


def _parser_flags(parser: argparse.ArgumentParser) -> frozenset[str]:
    return frozenset(o for a in parser._actions for o in a.option_strings if o.startswith("--"))


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _from_parser(parser: argparse.ArgumentParser) -> Command:
    subs = _subparsers(parser)
    assert subs, parser.prog
    return Command(
        subs={name: _parser_flags(p) for name, p in subs.items()},
        abbrev=frozenset(n for n, p in subs.items() if p.allow_abbrev),
        passthrough=frozenset(n for n, p in subs.items() if p.get_default("passthrough")),
    )


def _help(main: Callable[[list[str]], object], argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        with contextlib.suppress(SystemExit):
            main(argv)
    return out.getvalue()


def _from_help(main: Callable[[list[str]], object], subs: tuple[str, ...]) -> Command:
    """A command whose parser is built inside its main(): its subcommands' --help."""
    flags = {s: frozenset(FLAG_RE.findall(_help(main, [s, "--help"]))) for s in subs}
    assert all(flags.values()), flags
    return Command(subs=flags, abbrev=frozenset(subs))


@lru_cache(maxsize=1)
def commands() -> dict[str, Command]:
    usage = re.search(r"\{([^}]*)\}", _help(runtime_main, ["--help"]))  # usage: ... {doctor}
    assert usage, "no subcommand in hicache-async-ack --help"
    runtime_subs = usage.group(1)
    runtime = _from_help(runtime_main, tuple(runtime_subs.split(",")))
    return {
        "hicache-async-ack": Command(
            runtime.subs, runtime.abbrev, after_separator=frozenset({"doctor"})
        ),
        "hicache-async-ack-lab": _from_parser(lab_parser()),
        "python -m hicache_async_ack_lab.releases": _from_parser(lab_releases.build_parser()),
        "python -m hicache_async_ack_lab.bench.step_profile": _from_help(
            step_profile.main, ("python", "collective")
        ),
    }


@lru_cache(maxsize=1)
def launch_flags() -> frozenset[str]:
    """launch_server's options (SGLang's own parser)."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return _parser_flags(parser)


def takes(flag: str, flags: frozenset[str], abbrev: bool) -> bool:
    """Whether a parser with ``flags`` accepts ``flag`` (argparse's unique prefixes too)."""
    if flag in flags or flag == "--help":
        return True
    return abbrev and len([f for f in flags if f.startswith(flag)]) == 1


@lru_cache(maxsize=None)
def source_text(what: str) -> str:
    """The sources a name may be defined in, as one text: SGLang's package, ours (the
    runtime's and the lab's), or the scripts."""
    if what == "sglang":
        import sglang

        files = sorted(Path(sglang.__file__).parent.rglob("*.py"))
    elif what == "ours":
        files = sorted((ROOT / "python").rglob("*.py")) + sorted((ROOT / "lab").rglob("*.py"))
    elif what == "scripts":
        files = sorted((ROOT / "scripts").glob("*.sh"))
    else:
        raise ValueError(f"unknown source {what!r}: sglang, ours or scripts")
    assert files, what
    return "\n".join(p.read_text(errors="replace") for p in files)


def defined_in(name: str, what: str) -> bool:
    """``name`` as a string literal of Python sources, or as a word of the scripts."""
    text = source_text(what)
    if what == "scripts":
        return re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text) is not None
    return f'"{name}"' in text or f"'{name}'" in text


@lru_cache(maxsize=1)
def env_vars() -> frozenset[str]:
    from sglang.srt.environ import Envs

    ours = {getattr(plugin_env, n) for n in plugin_env.__all__ if n.endswith("_VAR")}
    assert len(ours) >= 6, ours
    return frozenset(ours | {n for n in vars(Envs) if ENV_RE.fullmatch(n)})


def env_exists(name: str) -> bool:
    return name in env_vars() or any(defined_in(name, w) for w in ("ours", "scripts", "sglang"))


@lru_cache(maxsize=1)
def exported() -> frozenset[str]:
    """Every series name the plugin exports, both spellings, with Prometheus's suffixes."""
    declared = {PATH_INFO, *SERIES}
    declared |= {name for families in FAMILIES.values() for _, _, name, *_ in families}
    suffixes = ("", "_total", "_sum", "_count", "_bucket", "_created")
    return frozenset(
        (n + s).replace(":", sep, 1) for n in declared for s in suffixes for sep in ":_"
    )


def metric_exists(name: str) -> bool:
    return name in exported() or defined_in(name, "sglang")


# ------------------------------------------------------------------ the docs
def code_spans(text: str) -> list[str]:
    """Fenced blocks, each line with its continuations joined, and inline code."""
    spans = []
    for block in re.findall(r"```[^\n]*\n(.*?)```", text, re.S):
        spans += block.replace("\\\n", " ").splitlines()
    spans += re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    return spans


def at_command_start(before: str) -> bool:
    """Whether what precedes a command's name in a span leaves it a command: nothing, a
    shell separator, `--` (another command's), a prompt, `=` or a variable assignment."""
    before = before.rstrip()
    if not before or before.endswith((";", "&&", "|", "(", "--", "$", "=", "#")):
        return True
    return re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", before.split()[-1]) is not None


def command_problems(span: str, known: dict[str, Command]) -> list[str]:
    problems = []
    progs = "|".join(re.escape(p) for p in sorted(known, key=len, reverse=True))
    for m in re.finditer(rf"(?<![\w/.-])({progs})[ \t]+([a-z][a-z-]*)", span):
        prog, sub = m.group(1), m.group(2)
        if not at_command_start(span[: m.start()]):
            continue  # the name in a quoted message or a sentence, not a command line
        command = known[prog]
        if sub not in command.subs:
            problems.append(f"`{prog} {sub}`: no such subcommand (one of {sorted(command.subs)})")
            continue
        rest = END_RE.split(span[m.end() :], 1)[0]
        own, *after = SEPARATOR_RE.split(rest, 1)
        launch = sub in command.passthrough
        for flag in FLAG_RE.findall(own):
            if not takes(flag, command.subs[sub], sub in command.abbrev) and not (
                launch and takes(flag, launch_flags(), True)
            ):
                problems.append(f"`{prog} {sub} {flag}`: no such flag")
        if after and sub in command.after_separator:
            for flag in FLAG_RE.findall(after[0]):
                if not takes(flag, launch_flags(), True):
                    problems.append(f"`{prog} {sub} -- {flag}`: not a launch_server flag")
    return problems


def any_flag_exists(flag: str, known: dict[str, Command]) -> bool:
    """A flag quoted on its own: some parser of ours, launch_server's, a script's, or
    another tool of SGLang's (bench_serving, the router) has it."""
    for command in known.values():
        for sub, flags in command.subs.items():
            if takes(flag, flags, sub in command.abbrev):
                return True
    return takes(flag, launch_flags(), True) or any(
        defined_in(flag, w) for w in ("ours", "scripts", "sglang")
    )


def script_problems(span: str) -> list[str]:
    m = re.search(r"(?<![\w/.-])(scripts/[\w.-]+\.sh)\b(.*)", span)
    if not m or not (ROOT / m.group(1)).is_file():
        return []  # a missing script is named by the text check
    script = (ROOT / m.group(1)).read_text()
    rest = END_RE.split(m.group(2), 1)[0]
    return [
        f"`{m.group(1)} {flag}`: the script has no such option"
        for flag in FLAG_RE.findall(rest)
        if flag not in script and not any_flag_exists(flag, commands())
    ]


def problems(text: str) -> list[str]:
    """What ``text`` (a doc) names that does not exist."""
    out = [f"{v}: no such environment variable" for v in sorted(set(ENV_RE.findall(text)))
           if not env_exists(v)]  # fmt: skip
    out += [f"{n}: no such metric" for n in sorted(set(METRIC_RE.findall(text)))
            if not metric_exists(n)]  # fmt: skip
    out += [f"{s}: no such script" for s in sorted(set(SCRIPT_RE.findall(text)))
            if not (ROOT / s).is_file()]  # fmt: skip
    known = commands()
    for span in code_spans(text):
        out += command_problems(span, known)
        out += script_problems(span)
        if span.startswith("--"):
            out += [f"`{f}`: no such flag" for f in FLAG_RE.findall(span)[:1]
                    if not any_flag_exists(f, known)]  # fmt: skip
    return out


# ------------------------------------------------------------------ the tests
def test_the_docs_are_the_ones_checked():
    names = {p.relative_to(ROOT).as_posix() for p in DOCS}
    assert {"README.md", "docs/design.md", "docs/monitoring.md", "docs/upgrade.md"} <= names
    assert all((ROOT / e).is_file() for e in EXEMPT), EXEMPT


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_name_a_doc_gives_exists(doc: Path):
    text = doc.read_text()
    found = ENV_RE.findall(text) + METRIC_RE.findall(text) + code_spans(text)
    assert found, f"{doc.name} names nothing: the extraction is broken"
    assert problems(text) == []


def test_the_check_finds_bogus_names():
    """Negative control: one bogus name of each kind, beside real ones that pass."""
    doc = "\n".join(
        [
            "Set `SGLANG_ENABLE_HICACHE_ASYNC_ACK_SYNC=0` or SGLANG_HICACHE_ASYNC_ACK_BOGUS=1.",
            "Read `sglang:hicache_ack_sync_wait_seconds_sum` and sglang_hicache_ack_sync_bogus.",
            "Run `hicache-async-ack doctor` or `hicache-async-ack diagnose`; the error",
            "reads `a peer runs the hicache-async-ack plugin` (a message, not a command).",
            "```bash",
            "hicache-async-ack-lab bench --tp 2 --no-such-flag \\",
            "  --steps 10   # a comment --not-a-flag",
            "hicache-async-ack-lab cpu-server --tp 2 --enable-hierarchical-cache --cpu-skew 0,3",
            "hicache-async-ack doctor -- --tp 4 --no-launch-flag",
            "bash scripts/bench.sh --seed-table --no-bench-mode",
            "```",
            "The flag `--cpu-skew 0,3`, the retired `--no-longer-there`; scripts/nothing.sh.",
        ]
    )
    assert sorted(problems(doc)) == sorted(
        [
            "SGLANG_HICACHE_ASYNC_ACK_BOGUS: no such environment variable",
            "sglang_hicache_ack_sync_bogus: no such metric",
            "scripts/nothing.sh: no such script",
            "`hicache-async-ack diagnose`: no such subcommand (one of ['doctor'])",
            "`hicache-async-ack-lab bench --no-such-flag`: no such flag",
            "`hicache-async-ack doctor -- --no-launch-flag`: not a launch_server flag",
            "`scripts/bench.sh --no-bench-mode`: the script has no such option",
            "`--no-longer-there`: no such flag",
        ]
    )


# ------------------------------------------------------------------ README's lists
def readme_section(title: str, text: Optional[str] = None) -> str:
    text = (ROOT / "README.md").read_text() if text is None else text
    assert f"\n## {title}\n" in text, title
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def readme_hooks(section: str) -> dict[str, tuple[frozenset[str], frozenset[str]]]:
    """README's hook table: method -> (hook kinds, syncs)."""
    rows = re.findall(r"^\| `([\w.]+)` \| ([A-Z, ]+) \| ([a-z_, ]+) \|$", section, re.M)
    return {m: (frozenset(k.split(", ")), frozenset(s.split(", "))) for m, k, s in rows}


def readme_relied_on(section: str) -> set[str]:
    (para,) = re.findall(r"relies on, without hooking them.*?(?:\n\n|$)", section, re.S)
    return set(re.findall(r"`([\w.]+)`", para))


@pytest.fixture
def registered(monkeypatch, environment_kept) -> dict[str, tuple[frozenset[str], frozenset[str]]]:
    """What register() registers with SGLang's HookRegistry, every sync on: method ->
    (hook kinds, the syncs served)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    calls: list[tuple[str, str, object]] = []

    def record(target, fn, kind=None, *args, **kwargs):
        calls.append((target, getattr(kind, "name", str(kind)), fn))

    monkeypatch.setattr(HookRegistry, "register", record)
    for name in plugin_env.__all__:
        if name.endswith("_VAR"):
            monkeypatch.delenv(getattr(plugin_env, name), raising=False)
    register(Environment())
    out: dict[str, tuple[set[str], set[str]]] = {}
    for target, kind, fn in calls:
        method = ".".join(target.rsplit(".", 2)[-2:])
        kinds, syncs = out.setdefault(method, (set(), set()))
        kinds.add(kind)
        syncs.update(hooked_for(fn))
    assert out, "register() registered nothing"
    return {m: (frozenset(k), frozenset(s)) for m, (k, s) in out.items()}


def test_readme_lists_every_hooked_method(registered):
    assert readme_hooks(readme_section("What it hooks in SGLang")) == registered


def test_readme_lists_every_method_relied_on():
    hooked = set(readme_hooks(readme_section("What it hooks in SGLang")))
    relied = {t.qualname for t in TARGETS} - hooked
    assert relied, "every target is hooked: the list below checks nothing"
    assert readme_relied_on(readme_section("What it hooks in SGLang")) == relied


def test_the_hook_list_check_finds_a_lost_and_an_extra_row(registered):
    """Negative control: README's table without one registered method, and with one
    SGLang method that nothing hooks, differs from the registrations."""
    section = readme_section("What it hooks in SGLang")
    listed = readme_hooks(section)
    first = next(iter(registered))
    lost = re.sub(rf"^\| `{re.escape(first)}` .*\n", "", section, flags=re.M)
    assert first in listed and first not in readme_hooks(lost)
    extra = section + "| `UnifiedRadixCache.evict` | AFTER | ack_counts |\n"
    assert readme_hooks(lost) != registered and readme_hooks(extra) != registered


def test_readme_lists_every_series_the_plugin_exports():
    section = readme_section("Metrics")
    listed = set(re.findall(r"^\| `(sglang:[a-z_]+)`", section, re.M))
    declared = {PATH_INFO, *SERIES}
    declared |= {name for families in FAMILIES.values() for _, _, name, *_ in families}
    assert declared
    missing = [n for n in sorted(declared) if n not in listed and f"{n}_total" not in listed]
    assert missing == []
