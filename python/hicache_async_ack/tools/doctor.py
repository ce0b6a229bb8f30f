"""``hicache-async-ack doctor [-- <launch_server arguments>]``: would the ack sync pipeline
on this node (and on this launch)? One exit code per cause (:mod:`.exits`); the verdict
on a launch is the plugin's own decision code run on what SGLang would build from it
(:mod:`.launch`). The gloo latency measurement runs only when asked for (``--measure``)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import textwrap
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from .. import __version__
from .. import env as plugin_env
from ..env import (
    ALLOW_UNTESTED_VAR,
    DEPTH_AUTO,
    DEPTH_MAX,
    DEPTH_VAR,
    ENABLE_VAR,
    ENTRY_POINT_NAME,
    PLUGINS_VAR,
    allow_untested,
    parse_bool,
    parse_depth,
    plugin_whitelisted,
)
from ..guard import Judged, Verdict, check_installed
from ..names import ACK, ACK_COUNTS, BY_NAME, SYNC_NAMES, SyncName
from ..protocol import PROTOCOL_VERSION
from .exits import Exit, exit_table
from .launch import (
    REFERENCE_TEXT,
    Launch,
    LaunchRejected,
    SyncVerdict,
    guard_decision,
    judge,
    judge_reference,
    parse_launch,
)
from .measure import TENSOR_LEN, measure
from .options import int_in, subcommand

GROUP = "sglang.srt.plugins"
WIDTH = 100  # every line doctor prints fits this (a path longer than it stays whole)
DEFAULT_ROUNDS = 200
KEY = 16  # the key column of the short sections
GUARD_CODES = ("untested_release", "not_in_release")  # register() hooks nothing of the sync


def wrap(text: str, first: str = "", rest: str = "    ") -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=first, subsequent_indent=rest,
                         break_long_words=False, break_on_hyphens=False) or [first]  # fmt: skip


def row(key: str, value: str, width: int = KEY) -> list[str]:
    head = f"  {key.ljust(width)}  "
    return wrap(value, head, " " * len(head))


@dataclass
class Report:
    """What doctor found: the printed lines, each cause keeping the ack sync off with
    its exit code, the syncs' verdicts, the launch judged (None: the reference ones)."""

    lines: list[str] = field(default_factory=list)
    causes: list[tuple[Exit, str]] = field(default_factory=list)
    syncs: dict[SyncName, SyncVerdict] = field(default_factory=dict)
    launch: Optional[Launch] = None
    loads: bool = False  # SGLang's loader would call register() here

    @property
    def code(self) -> Exit:
        return min((code for code, _ in self.causes), default=Exit.LIVE)

    def add(self, *lines: str) -> None:
        self.lines.extend(lines)

    def verdict(self) -> list[str]:
        """The verdict, then how to see the plugin working (always the last line)."""
        code = self.code
        if code == Exit.LIVE:
            if self.launch is not None:
                what = "would pipeline on this launch"
            else:
                what = (
                    "is allowed on this node; `doctor -- <launch_server arguments>` judges a launch"
                )
            out = wrap(f"verdict: ACTIVE (exit 0): the ack sync {what}")
        else:
            first = min(self.causes)
            out = wrap(f"verdict: INACTIVE (exit {code.value}): {first[1]}")
            out += [x for _, why in sorted(self.causes)[1:] for x in wrap(why, "  also: ")]
        extras = [s for s, v in self.syncs.items() if s != ACK and v.live]
        if extras and code != Exit.LIVE:
            out += wrap(f"still live (extras, not judged by the exit code): {', '.join(extras)}",
                        "  ")  # fmt: skip
        if self.loads or code == Exit.LIVE:
            out += see_it_working(self.syncs.get(ACK), code == Exit.LIVE)
        return out


def see_it_working(ack: Optional[SyncVerdict], live: bool) -> list[str]:
    # imported here: metrics stays unimported (nothing created) where metrics are off, and
    # the rank spawner a test imports from tools shares this package
    from ..metrics import FAMILIES, PATH_INFO

    line = ack.line if ack is not None and ack.live else f"{ACK_COUNTS.title}: pipelined ..."
    gauge = next(f[2] for f in FAMILIES[ACK_COUNTS.name] if f[0] == "pipelined")
    when = "see it working" if live else "once fixed, see it working"
    return wrap(
        f'{when}: each scheduler rank logs "{line}" (grep "{ACK_COUNTS.title}:"); '
        f"with --enable-metrics, /metrics shows {gauge} 1 and "
        f'{PATH_INFO}{{sync="{ACK}",path="pipelined"}} 1'
    )


def diagnose(launch: Optional[Sequence[str]] = None, verbose: bool = False) -> Report:
    """Judge this node, and ``launch`` (the launch_server arguments) if given."""
    rep = Report()
    rep.add(f"hicache-async-ack doctor: plugin {__version__}, wire protocol {PROTOCOL_VERSION}")
    sglang = sglang_location()
    if sglang is None:
        rep.causes.append((Exit.NO_SGLANG, f"no SGLang importable by {sys.executable}: run "
                           "doctor with the Python that runs SGLang"))  # fmt: skip
        return rep  # the verdict says it: nothing else here concerns SGLang's Python
    rep.add(*row("python", sys.executable))
    if not add_switch(rep):
        return rep
    add_loader(rep, sglang)
    add_settings(rep)
    judged = add_guard(rep, verbose)
    if launch is not None:
        try:
            rep.launch = parse_launch(launch)
        except LaunchRejected as exc:
            rep.add(*wrap(f"launch: {' '.join(launch) or '(none)'}"))
            rep.causes.append((Exit.LAUNCH_REJECTED, f"SGLang's launch_server would refuse "
                               f"these arguments: {exc}"))  # fmt: skip
            return rep
    if any(code == Exit.INVALID_SETTING for code, _ in rep.causes):
        rep.add("syncs: not judged (register() hooks none of them while a setting is invalid)")
        return rep
    add_syncs(rep, judged)
    return rep


def sglang_location() -> Optional[str]:
    """Where this Python imports SGLang from (None: it cannot)."""
    try:
        spec = importlib.util.find_spec("sglang")
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    return next(iter(spec.submodule_search_locations or []), spec.origin or "?")


def add_switch(rep: Report) -> bool:
    """The switch, read first as register() reads it; False: nothing else is judged."""
    raw = os.environ.get(ENABLE_VAR)
    try:
        on = parse_bool(ENABLE_VAR, raw, plugin_env.ENABLE_DEFAULT)
    except ValueError as exc:
        rep.add(*row(ENABLE_VAR, f"INVALID: {exc}", 0))
        rep.causes.append((Exit.INVALID_SETTING, f"{ENABLE_VAR}={raw!r} is invalid: HiCache "
                           "init would raise (a server with HiCache would not start); the "
                           "plugin reads no other setting"))  # fmt: skip
        return False
    if not on:
        rep.add(*wrap(f"{ENABLE_VAR}={raw!r}: the plugin is switched off; it reads no other "
                      "setting and registers nothing, so nothing else is judged"))  # fmt: skip
        rep.causes.append((Exit.SWITCHED_OFF, f"switched off by {ENABLE_VAR}={raw} (unset it, "
                           "or set it to 1, on every node)"))  # fmt: skip
    return on


def add_loader(rep: Report, sglang: str) -> None:
    from importlib import metadata

    def version(dist: str) -> Optional[str]:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the package
    dist = version("hicache-async-ack")
    if dist is None:
        installed = "NOT installed as a distribution"
    elif dist != __version__:
        installed = f"installed metadata says {dist} (a stale install?)"
    else:
        installed = f"installed as hicache-async-ack {dist}"
    rep.add(*row("plugin", here), *row("", installed))
    torch = version("torch") or "not installed"
    rep.add(*row("SGLang", f"{version('sglang') or 'version unknown'}, torch {torch}"))
    rep.add(*row("", f"imported from {sglang}"))
    from importlib.metadata import entry_points

    ep = next((e for e in entry_points(group=GROUP) if e.name == ENTRY_POINT_NAME), None)
    if ep is None:
        rep.add(*row("entry point", f"MISSING: no {ENTRY_POINT_NAME!r} in group {GROUP}"))
        rep.causes.append((Exit.NO_ENTRY_POINT, "the entry point is not installed, so SGLang's "
                           "loader never calls the plugin: pip install the runtime wheel into "
                           "this environment"))  # fmt: skip
    else:
        rep.add(*row("entry point", f"{ep.name} = {ep.value} (group {GROUP})"))
    raw = os.environ.get(PLUGINS_VAR)
    if plugin_whitelisted():
        rep.add(*row(PLUGINS_VAR, f"{raw!r}: lists it" if raw else "unset: every plugin loads"))
    else:
        rep.add(*row(PLUGINS_VAR, f"{raw!r}: SKIPPED ({ENTRY_POINT_NAME} not listed)"))
        rep.causes.append((Exit.EXCLUDED, f"{PLUGINS_VAR}={raw!r} does not list "
                           f"{ENTRY_POINT_NAME}, so SGLang's loader skips it"))  # fmt: skip
    rep.loads = ep is not None and plugin_whitelisted()


# --------------------------------------------------------------- the settings
# variable -> (what on means, what off means): each switch's own row (env.SWITCHES)
MEANING: dict[str, tuple[str, str]] = {s.var: (s.on, s.off) for s in plugin_env.SWITCHES}


def plugin_settings() -> list[tuple[str, Callable[[str, Optional[str], Any], Any], Any]]:
    """(variable, parser, default) of every setting env.py declares (``X_VAR`` with its
    ``X_DEFAULT``), the switch first: a new one is a row here without a change."""
    out = []
    for name in plugin_env.__all__:
        default = getattr(plugin_env, name.removesuffix("_VAR") + "_DEFAULT", None)
        if name.endswith("_VAR") and default is not None:
            parse = parse_bool if isinstance(default, bool) else parse_depth
            out.append((getattr(plugin_env, name), parse, default))
    return sorted(out, key=lambda s: s[0] != ENABLE_VAR)


def describe(var: str, value: Any) -> tuple[str, str]:
    """(the value as a word, what it means)."""
    if var == DEPTH_VAR:
        if value == DEPTH_AUTO:
            return "auto", f"the ranks move the lag depth together from 1 to {DEPTH_MAX}"
        return str(value), f"acks popped {value} step{'s' if value != 1 else ''} late"
    on, off = MEANING.get(var, ("", ""))
    return ("on", on) if value else ("off", off)


def add_settings(rep: Report) -> None:
    settings = plugin_settings()
    rep.add("settings (read by the plugin in every scheduler process)")
    width = max(len(var) for var, _, _ in settings)
    for var, parse, default in settings:
        raw = os.environ.get(var)
        shown = "unset" if raw is None else repr(raw)
        try:
            value = parse(var, raw, default)
        except ValueError as exc:
            rep.add(*row(var, f"{shown}: INVALID: {exc}", width))
            rep.causes.append((Exit.INVALID_SETTING, f"{var}={raw!r} is invalid: HiCache init "
                               "would raise (a server with HiCache would not start)"))  # fmt: skip
            continue
        word, meaning = describe(var, value)
        default_note = " (default)" if raw is None else ""
        rep.add(*row(var, f"{shown} -> {word}{default_note}: {meaning}".rstrip(": "), width))


# --------------------------------------------------------------- the guard
def add_guard(rep: Report, verbose: bool) -> Judged:
    """The installed SGLang against the tested releases, per sync (register()'s verdict)."""
    from ..sglang_plugin import IN_TREE_MODULE, carries_the_sync_itself

    try:
        untested_ok = allow_untested()
    except ValueError:
        untested_ok = False  # reported with the settings
    if carries_the_sync_itself():
        rep.causes.append((Exit.IN_TREE, f"this SGLang carries the pipelined ack sync itself "
                           f"({IN_TREE_MODULE}): the plugin registers nothing; its own log "
                           "line says how it runs"))  # fmt: skip
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            verdict: Optional[Verdict] = check_installed()
    except Exception as exc:  # noqa: BLE001 (a broken table: register() hooks nothing)
        rep.add(*row("version guard", f"cannot judge this SGLang: {exc!r}"))
        rep.causes.append((Exit.GUARD, "the version guard cannot judge this SGLang"))
        return Judged(None, untested_ok)
    assert verdict is not None
    where = "in" if verdict.in_range else "OUTSIDE"
    rep.add(*wrap(f"version guard (is each sync supported here? each method: --verbose): SGLang "
                  f"{verdict.installed or '(version unknown)'}, {where} the tested range "
                  f"{verdict.range_text}"))  # fmt: skip
    if verbose:
        for m in verdict.methods:
            rep.add(*wrap(m.describe(), f"    {m.target.label}: ", "        "))
    for sync in SYNC_NAMES:
        fv = verdict.feature(sync)
        summary = fv.summary(verdict)
        if fv.status == "tested":
            text = f"yes: {summary}"
        elif fv.status == "absent":
            text = f"NO, not in this SGLang: {summary}"
        elif fv.status == "untested" and untested_ok:
            text = f"UNTESTED, runs anyway ({ALLOW_UNTESTED_VAR}=1): {summary}"
        elif fv.status == "untested":
            text = f"NO, stands down: {summary} ({ALLOW_UNTESTED_VAR}=1 runs it anyway)"
        else:
            text = f"NO, stands down: {summary}"
        rep.add(*row(sync, text))
    judged = Judged(verdict, untested_ok)
    if guard_decision(ACK, judged) is not None:
        summary = verdict.feature(ACK).summary(verdict)
        rep.causes.append((Exit.GUARD, f"the version guard keeps the ack sync off: {summary}"))
    return judged


# --------------------------------------------------------------- the syncs
def add_syncs(rep: Report, judged: Judged) -> None:
    launch = rep.launch
    if launch is None:
        rep.syncs = judge_reference(judged)
        rep.add(*wrap("syncs (no launch given: each judged on a launch it serves; "
                      "`doctor -- <launch_server arguments>` judges yours)"))  # fmt: skip
    else:
        rep.syncs = judge(launch, judged)
        rep.add(*wrap(f"launch: {' '.join(launch.argv) or '(none: SGLang defaults)'}"))
        rep.add(*wrap(f"read by SGLang's own parser (no model loaded, its model-dependent "
                      f"resolution not run): {launch.describe()}", "  ", "  "))  # fmt: skip
        rep.add("syncs on this launch (the plugin's own decision code on what SGLang builds)")
    for sync, v in rep.syncs.items():
        rep.add(*row(sync, status(v, launch is None)))
        if v.note and v.decision is not None:
            rep.add(*wrap(f"note: {v.note}", " " * (KEY + 4), " " * (KEY + 6)))
    ack = rep.syncs[ACK]
    if not ack.live and ack.decision is not None and ack.decision.code not in GUARD_CODES:
        rep.causes.append((Exit.STANDS_DOWN, f"the ack sync stands down on this launch "
                           f"({ack.decision.code}): {ack.decision.reason}"))  # fmt: skip


def status(v: SyncVerdict, reference: bool) -> str:
    if v.decision is None:
        return f"idle: {v.note}" if v.note else "idle"
    if v.live:
        how = v.line.removeprefix(f"{BY_NAME[v.sync].title}: ")
        return f"allowed (on {REFERENCE_TEXT[v.sync]})" if reference else f"live: {how}"
    code = v.decision.code
    why = "the version guard keeps it off (above)" if code in GUARD_CODES else v.decision.reason
    return f"standing down ({code}): {why}"


# --------------------------------------------------------------- the command
def run(args: argparse.Namespace) -> int:
    rep = diagnose(args.launch, args.verbose)
    print("\n".join(rep.lines), flush=True)
    rounds = DEFAULT_ROUNDS if args.rounds is None else args.rounds
    if (args.measure or args.rounds) and rep.code != Exit.NO_SGLANG:  # asked for: informational
        if rounds == 0:
            print("  gloo all_reduce: not measured (--rounds 0)")
        else:
            print("\n".join(wrap(
                f"measuring (informational): {rounds} blocking MIN all_reduces of "
                f"{TENSOR_LEN} int64 over gloo between {args.tp} local processes on "
                "127.0.0.1, what the ack counts cost each step on SGLang's blocking path",
                "", "  ")), flush=True)  # fmt: skip
            print("\n".join(measure(args.tp, rounds, args.step_ms)))
    print("\n".join(rep.verdict()))
    return int(rep.code)


SUMMARY = "would the ack sync pipeline here, on this launch (-- <launch_server arguments>)?"
DESCRIPTION = textwrap.fill(
    "Judge this node: the interpreter's SGLang, the plugin's settings, its entry point, "
    "SGLANG_PLUGINS and the version guard; with `-- <launch_server arguments>`, judge that "
    "launch too, each sync by the plugin's own decision code. The exit status is the ack "
    "sync's (below); the prefetch votes and the decode offload sync are reported per line. "
    "--measure times the gloo all_reduce the blocking path runs (--tp ranks).",
    79,
)


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = subcommand(sub, "doctor", SUMMARY, DESCRIPTION, epilog=exit_table(),
                   usage="%(prog)s [options] [-- <launch_server arguments>]",
                   formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument(
        "--verbose",
        action="store_true",
        help="also each fingerprinted upstream method against the recorded ones",
    )
    p.add_argument(
        "--measure",
        action="store_true",
        help="time the gloo all_reduce of the blocking path (--tp local ranks)",
    )
    p.add_argument(
        "--rounds",
        type=int_in("--rounds", 0),
        default=None,
        help=f"all_reduces to time (implies --measure; default {DEFAULT_ROUNDS})",
    )
    p.set_defaults(func=run, launch=None)
    return p
