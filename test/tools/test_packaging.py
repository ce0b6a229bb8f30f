"""The two wheels (issues 35, 51): scripts/build-wheels.sh builds the runtime wheel
(the plugin and `doctor`, what GPU nodes install) and the lab's; each holds
what it should and nothing else (LICENSE and py.typed included, the metadata an
index shows), README's build command works from a bare `python -m venv`, and the
runtime wheel, installed alone into a fresh venv beside SGLang, runs `doctor` and
is picked up by SGLang's real load_plugins() from its own files, with the lab not
importable there.

The fresh venv reuses the project venv's SGLang (a reinstall is 11 GB) through
a ``.pth`` file holding that site-packages directory as a plain path line: site
appends such a line to sys.path but reads no ``.pth`` file inside it, so the
project's editable installs (path ``.pth`` files there) stay out. Their
dist-info directories stay visible to importlib.metadata, which keeps the
first distribution of a name on sys.path: the fresh venv's own site-packages
comes first. The checks read where each thing came from, and a venv with the
lab installed too is the negative control of "the lab is not importable".
"""

from __future__ import annotations

import configparser
import email.message
import email.parser
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import sysconfig
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from hicache_async_ack import __version__
from hicache_async_ack import tools as runtime_cli
from hicache_async_ack.guard import tested_releases
from hicache_async_ack_lab import cli as lab_cli
from hicache_async_ack_lab.intree import module as intree_files

ROOT = Path(__file__).resolve().parents[2]
RUNTIME, LAB = "hicache_async_ack", "hicache_async_ack_lab"
SOURCES = {RUNTIME: ROOT / "python" / RUNTIME, LAB: ROOT / "lab" / "python" / LAB}
PLUGIN_GROUP = "sglang.srt.plugins"
ENTRY_POINT = "hicache_async_ack = hicache_async_ack.sglang_plugin:register"
LAB_REQUIRES = f"hicache-async-ack=={__version__}"
LICENSE = "Apache-2.0"
MOONCAKE_CPU = "mooncake-transfer-engine-non-cuda"  # installs mooncake/, as the CUDA wheel does
# Minutes on a busy 2-core box: SGLang's import dominates every probe.
BUILD_TIMEOUT_S, PIP_TIMEOUT_S, PROBE_TIMEOUT_S = 600, 300, 600


# ------------------------------------------------------------ the wheels
@dataclass(frozen=True)
class Wheel:
    path: Path
    names: tuple[str, ...]
    metadata: email.message.Message
    entry_points: configparser.ConfigParser

    @classmethod
    def read(cls, path: Path) -> "Wheel":
        with zipfile.ZipFile(path) as z:
            names = tuple(z.namelist())
            info = [
                n for n in names if n.count("/") == 1 and n.split("/")[0].endswith(".dist-info")
            ]
            dist_info = info[0].split("/")[0] if info else "missing.dist-info"
            text = {n: z.read(n).decode() for n in names if n.startswith(dist_info + "/")}
        eps = configparser.ConfigParser(delimiters=("=",))
        eps.optionxform = str  # entry point names are case-sensitive
        eps.read_string(text.get(f"{dist_info}/entry_points.txt", ""))
        meta = email.parser.Parser().parsestr(text.get(f"{dist_info}/METADATA", ""))
        return cls(path, names, meta, eps)

    def files(self, package: str) -> set[str]:
        return {n for n in self.names if n.startswith(package + "/")}

    def requires(self) -> list[str]:
        """The unconditional requirements (extras' are not installed by default)."""
        return [r for r in self.metadata.get_all("Requires-Dist") or [] if "extra ==" not in r]

    def extra(self, name: str) -> list[str]:
        """What extra ``name`` requires (each requirement without its marker)."""
        marker = f'extra == "{name}"'
        reqs = self.metadata.get_all("Requires-Dist") or []
        return [r.split(";")[0].strip() for r in reqs if marker in r]


def source_files(package: str) -> set[str]:
    """What the package's wheel must hold: its modules, the data it ships, py.typed."""
    src = SOURCES[package]
    found = [p for p in src.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    data = ("upstream_fingerprints.json", "py.typed")
    keep = [p for p in found if p.suffix == ".py" or p.name in data]
    return {f"{package}/{p.relative_to(src).as_posix()}" for p in keep}


def common_problems(wheel: Wheel, package: str, name: str) -> list[str]:
    problems = []
    dist_info = f"{package}-{__version__}.dist-info/"
    stray = [n for n in wheel.names if not n.startswith((package + "/", dist_info))]
    if stray:
        problems.append(f"files outside {package}/: {sorted(stray)}")
    missing = source_files(package) - wheel.files(package)
    if missing:
        problems.append(f"missing: {sorted(missing)}")
    for must in (f"{package}/py.typed", f"{dist_info}licenses/LICENSE"):
        if must not in wheel.names:
            problems.append(f"without {must}")
    if (wheel.metadata["Name"], wheel.metadata["Version"]) != (name, __version__):
        problems.append(f"is {wheel.metadata['Name']} {wheel.metadata['Version']}")
    meta = wheel.metadata
    if meta["License-Expression"] != LICENSE or meta["Requires-Python"] != ">=3.10":
        problems.append(f"license {meta['License-Expression']}, python {meta['Requires-Python']}")
    if "Typing :: Typed" not in (meta.get_all("Classifier") or []):
        problems.append(f"classifiers {meta.get_all('Classifier')}")
    return problems


def runtime_problems(wheel: Wheel) -> list[str]:
    """What is wrong with a runtime wheel (empty: nothing)."""
    problems = common_problems(wheel, RUNTIME, "hicache-async-ack")
    # What only the lab may carry: its package, cpu-server's sitecustomize, the
    # files the patch adds (SGLang's code) and SGLang itself.
    foreign = [
        n
        for n in wheel.names
        if n.startswith((LAB + "/", "sglang/"))
        or "sitecustomize" in n
        or "/intree/" in n
        or "/files/" in n
    ]
    if foreign:
        problems.append(f"lab or SGLang files: {sorted(foreign)}")
    if wheel.requires():
        problems.append(f"requires {wheel.requires()}")
    tested = tested_releases()
    if wheel.extra("sglang") != [f"sglang<={tested[-1]},>={tested[0]}"]:
        problems.append(f"the sglang extra is {wheel.extra('sglang')}, not the tested range")
    if not wheel.metadata.get_all("Project-URL"):
        problems.append("no Project-URL")
    plugins = dict(wheel.entry_points[PLUGIN_GROUP]) if PLUGIN_GROUP in wheel.entry_points else {}
    if [f"{k} = {v}" for k, v in plugins.items()] != [ENTRY_POINT]:
        problems.append(f"entry points in {PLUGIN_GROUP}: {plugins}")
    return problems


def lab_problems(wheel: Wheel) -> list[str]:
    """What is wrong with a lab wheel (empty: nothing)."""
    problems = common_problems(wheel, LAB, "hicache-async-ack-lab")
    needed = [f"{LAB}/cpu_server/boot/sitecustomize.py"] + [
        f"{LAB}/intree/files/{rel}" for rel in (intree_files.MODULE_PATH, *intree_files.TEST_PATHS)
    ]
    absent = [n for n in needed if n not in wheel.names]
    if absent:
        problems.append(f"without {absent}")
    if wheel.requires() != [LAB_REQUIRES]:
        problems.append(f"requires {wheel.requires()}, not [{LAB_REQUIRES!r}]")
    # Mooncake's CPU build replaces a GPU node's CUDA one: opt-in only, never in bench.
    for extra in ("bench",):
        if any(r.startswith(MOONCAKE_CPU) for r in wheel.extra(extra)):
            problems.append(f"{MOONCAKE_CPU} in the {extra} extra")
    if not any(r.startswith(MOONCAKE_CPU) for r in wheel.extra("mooncake-cpu")):
        problems.append(f"no mooncake-cpu extra with {MOONCAKE_CPU}")
    return problems


WHEEL_NAMES = [f"{RUNTIME}-{__version__}-py3-none-any.whl", f"{LAB}-{__version__}-py3-none-any.whl"]


def run_build(command: list[str], env: dict[str, str]) -> tuple[str, str]:
    """Run a build command in its own session (the script runs its two builds in the
    background), killed with its group on a timeout: (stdout, stderr); it must succeed."""
    build = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = build.communicate(timeout=BUILD_TIMEOUT_S)
    finally:
        if build.poll() is None:
            os.killpg(build.pid, signal.SIGKILL)
            build.wait()
    assert build.returncode == 0, stderr[-3000:]
    return stdout, stderr


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, Wheel]:
    """Both wheels, built by scripts/build-wheels.sh with this interpreter."""
    out = tmp_path_factory.mktemp("dist")
    script = ["bash", str(ROOT / "scripts" / "build-wheels.sh"), str(out)]
    stdout, _ = run_build(script, {**os.environ, "PYTHON": sys.executable})
    printed = [Path(line) for line in stdout.split()]
    built = sorted(out.glob("*.whl"))
    assert [p.name for p in printed] == WHEEL_NAMES
    assert sorted(printed) == built
    return {RUNTIME: Wheel.read(printed[0]), LAB: Wheel.read(printed[1])}


def test_the_runtime_wheel_holds_the_plugin_and_doctor_and_nothing_else(wheels):
    runtime = wheels[RUNTIME]
    assert runtime_problems(runtime) == []
    for must in ("sglang_plugin.py", "tools/doctor.py", "upstream_fingerprints.json"):
        assert f"{RUNTIME}/{must}" in runtime.names
    assert dict(runtime.entry_points["console_scripts"]) == {
        "hicache-async-ack": "hicache_async_ack.tools.cli:main"
    }


def test_the_lab_wheel_holds_the_lab_and_requires_this_plugin_version(wheels):
    lab = wheels[LAB]
    assert lab_problems(lab) == []
    for package in ("bench", "cpu_server", "intree", "sim", "testing"):
        assert f"{LAB}/{package}/__init__.py" in lab.names
    assert dict(lab.entry_points["console_scripts"]) == {
        "hicache-async-ack-lab": "hicache_async_ack_lab.cli:main"
    }
    assert PLUGIN_GROUP not in lab.entry_points  # SGLang loads the plugin, never the lab


def readme_build_command() -> list[str]:
    """The build command of README's install section (a line of a bash block)."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    lines = [ln.split("#")[0].split() for b in blocks for ln in b.splitlines()]
    found = [ln for ln in lines if "scripts/build-wheels.sh" in ln]
    assert len(found) == 1, found
    return found[0]


def test_readmes_build_command_works_from_a_bare_venv(tmp_path):
    """A bare ``python -m venv`` (pip, nothing else), activated, and README's build
    command: both wheels, with no development set-up (no SGLang, no apt, no
    project venv). Prints how long it took."""
    command = readme_build_command()
    assert command == ["bash", "scripts/build-wheels.sh"], command
    venv = tmp_path / "bare"
    start = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=PIP_TIMEOUT_S)
    env = {k: v for k, v in clean_env().items() if k not in ("PYTHON", "HICACHE_ASYNC_ACK_VENV")}
    env.update(VIRTUAL_ENV=str(venv), PATH=f"{venv / 'bin'}:{env.get('PATH', '')}")
    _, stderr = run_build([*command, str(tmp_path / "dist")], env)
    took = time.monotonic() - start
    assert sorted(p.name for p in (tmp_path / "dist").glob("*.whl")) == WHEEL_NAMES
    assert "setup:" not in stderr  # scripts/setup.sh (the development set-up) did not run
    print(f"bare venv + README's build command: both wheels in {took:.1f} s")


def test_the_build_says_when_the_interpreter_has_no_pip(tmp_path):
    """A venv without pip: the script names the missing pip and builds nothing."""
    venv = tmp_path / "nopip"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120
    )
    env = {**clean_env(), "PYTHON": str(venv / "bin" / "python")}
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "build-wheels.sh"), str(tmp_path / "dist")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    assert "has no pip" in done.stderr and done.stdout == "", done.stderr
    assert not list((tmp_path / "dist").glob("*.whl"))


def readme_sizes() -> dict[str, float]:
    """README's install table: wheel -> the size it states, in KB."""
    rows = re.findall(
        r"^\| `(\w+)` \(.*\| about (\d+) KB \|$", (ROOT / "README.md").read_text(), re.M
    )
    return {name: float(kb) for name, kb in rows}


def test_readme_states_the_wheels_sizes(wheels):
    """Within 15% of the wheels just built (they grow with the code: measure again)."""
    stated = readme_sizes()
    assert set(stated) == {RUNTIME, LAB}, stated
    for name, wheel in wheels.items():
        built = wheel.path.stat().st_size / 1024
        print(f"{name}: {built:.0f} KB built, README says about {stated[name]:.0f} KB")
        assert abs(built - stated[name]) <= 0.15 * built, (name, built, stated[name])


def _rewrite(src: Wheel, dest: Path, drop: set[str], add: dict[str, str], edit) -> Wheel:
    """A copy of ``src`` without ``drop``, with ``add``, each text file through ``edit``."""
    with zipfile.ZipFile(src.path) as z, zipfile.ZipFile(dest, "w") as out:
        for name in src.names:
            if name not in drop:
                out.writestr(name, edit(name, z.read(name).decode()))
        for name, text in add.items():
            out.writestr(name, text)
    return Wheel.read(dest)


def test_the_wheel_checks_find_what_a_bad_wheel_carries(wheels, tmp_path):
    """Negative control: each check above fails on a wheel built to fail it."""
    runtime = wheels[RUNTIME]

    def add_requirement(name: str, text: str) -> str:
        if name.endswith("/METADATA"):
            text = text.replace("Requires-Python:", "Requires-Dist: sglang\nRequires-Python:", 1)
            return text.replace("sglang<=", "sglang<=9", 1)
        return text.replace(PLUGIN_GROUP, "other.group") if "entry_points" in name else text

    license_file = f"{RUNTIME}-{__version__}.dist-info/licenses/LICENSE"
    bad = _rewrite(
        runtime,
        tmp_path / runtime.path.name,
        drop={f"{RUNTIME}/guard.py", f"{RUNTIME}/py.typed", license_file},
        add={
            "sitecustomize.py": "",
            f"{LAB}/__init__.py": "",
            "sglang/__init__.py": "",
            f"{RUNTIME}/intree/files/x.py": "",
        },
        edit=add_requirement,
    )
    found = "\n".join(runtime_problems(bad))
    for what in (
        "guard.py",
        "sitecustomize.py",
        f"{LAB}/__init__.py",
        "sglang/__init__.py",
        "intree/files",
        "requires ['sglang']",
        "the sglang extra is ['sglang<=9",
        f"without {RUNTIME}/py.typed",
        f"without {license_file}",
        f"entry points in {PLUGIN_GROUP}: {{}}",
    ):
        assert what in found, what

    lab = wheels[LAB]
    sitecustomize = f"{LAB}/cpu_server/boot/sitecustomize.py"

    def other_version(name: str, text: str) -> str:
        text = text.replace(LAB_REQUIRES, "hicache-async-ack>=0.0.1")
        if name.endswith("/METADATA"):  # Mooncake's CPU build back in bench
            text = text.replace(
                "Provides-Extra: bench",
                f'Provides-Extra: bench\nRequires-Dist: {MOONCAKE_CPU}; extra == "bench"',
            )
        return text.replace("License-Expression: Apache-2.0", "License-Expression: MIT")

    bad_lab = _rewrite(
        lab, tmp_path / lab.path.name, drop={sitecustomize}, add={}, edit=other_version
    )
    found = "\n".join(lab_problems(bad_lab))
    assert sitecustomize in found and "requires ['hicache-async-ack>=0.0.1']" in found, found
    assert f"{MOONCAKE_CPU} in the bench extra" in found and "license MIT" in found, found


def test_the_lab_commands_are_the_ones_the_runtime_cli_sends_to_the_lab(capsys):
    usage = lab_cli.build_parser().format_usage()
    (choices,) = re.findall(r"\{([^}]*)\}", usage)
    assert tuple(choices.split(",")) == runtime_cli.LAB_COMMANDS
    assert runtime_cli.LAB_COMMANDS  # the loop below checks something
    for command in runtime_cli.LAB_COMMANDS:
        assert runtime_cli.main([command, "--help"]) == 2
        err = capsys.readouterr().err
        assert f"run `{runtime_cli.LAB_PROG} {command} --help`" in err, err
    # Control: a command the lab does not have gets argparse's answer, not the lab's.
    with pytest.raises(SystemExit) as exc:
        runtime_cli.main(["no-such-command"])
    assert exc.value.code == 2 and runtime_cli.LAB_PROG not in capsys.readouterr().err


# ------------------------------------------------------------ a fresh venv
PROBE = """
import importlib.util, json, logging, sys
from importlib import metadata
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s %(message)s")
out = {"lab": getattr(importlib.util.find_spec("hicache_async_ack_lab"), "origin", None)}
out["dist"] = str(metadata.distribution("hicache-async-ack").locate_file(""))
out["entry_points"] = [
    [ep.value, str(ep.dist.locate_file(""))]
    for ep in metadata.entry_points(group="sglang.srt.plugins")
    if ep.name == "hicache_async_ack"
]
if "--load" in sys.argv:
    before = "hicache_async_ack.sglang_plugin" in sys.modules
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache as C
    plugin = sys.modules.get("hicache_async_ack.sglang_plugin")
    out["imported_before_load"] = before
    out["loaded_from"] = getattr(plugin, "__file__", None)
    names = ("init_hicache", "check_hicache_events", "_sync_hicache_ready_counts")
    out["hooked"] = [plugin.is_hooked(getattr(C, n)) for n in names] if plugin else []
print("PROBE " + json.dumps(out))
"""


def clean_env() -> dict[str, str]:
    """No path, venv or SGLang setting of this process reaches the fresh venv."""
    drop = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("SGLANG_")}
    return {**env, "PYTHONNOUSERSITE": "1"}


def beside_sglang() -> list[str]:
    """The directory SGLang is imported from here, then this venv's site-packages
    (SGLang's dependencies), as the fresh venv's .pth lists them."""
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.origin is not None, "SGLang is not installed here"
    dirs = [str(Path(spec.origin).parents[1]), sysconfig.get_paths()["purelib"]]
    return list(dict.fromkeys(dirs))


def make_venv(where: Path, wheel_paths: list[Path]) -> tuple[Path, Path]:
    """A venv of this Python with only these wheels installed (no dependencies)
    and SGLang reachable: (its python, its site-packages)."""
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=120
    )
    python = where / "bin" / "python"
    done = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        env=clean_env(),
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    site = Path(done.stdout.strip())
    (site / "beside_sglang.pth").write_text("".join(f"{d}\n" for d in beside_sglang()))
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps"]
    pip += ["--no-index", "--disable-pip-version-check", "-q", *map(str, wheel_paths)]
    done = subprocess.run(pip, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return python, site


def run_all(commands: dict[str, list[str]]) -> dict[str, tuple[int, str]]:
    """The commands at once, in the clean environment: (exit status, output).
    Each has its own process group, killed if anything goes wrong."""
    procs = {
        name: subprocess.Popen(
            cmd,
            env=clean_env(),
            cwd="/",  # no checkout on the path
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for name, cmd in commands.items()
    }
    out = {}
    try:
        for name, proc in procs.items():
            text, _ = proc.communicate(timeout=PROBE_TIMEOUT_S)
            out[name] = (proc.returncode, text)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return out


def probed(text: str) -> dict:
    lines = [line for line in text.splitlines() if line.startswith("PROBE ")]
    assert len(lines) == 1, text[-3000:]
    return json.loads(lines[0][len("PROBE ") :])


@pytest.fixture(scope="module")
def runtime_alone(wheels, tmp_path_factory) -> tuple[Path, dict[str, tuple[int, str]]]:
    """The runtime wheel alone in a fresh venv: its site-packages and what
    `doctor`, a lab command and SGLang's loader said there."""
    python, site = make_venv(tmp_path_factory.mktemp("runtime-venv"), [wheels[RUNTIME].path])
    script = str(python.parent / "hicache-async-ack")
    return site, run_all(
        {
            "doctor": [script, "doctor", "--rounds", "0"],
            "lab_command": [script, "upstream-patch"],
            "probe": [str(python), "-c", PROBE, "--load"],
        }
    )


def test_doctor_runs_from_the_runtime_wheel_alone_beside_sglang(runtime_alone):
    site, out = runtime_alone
    rc, text = out["doctor"]
    assert rc == 0, text[-3000:]
    flat = " ".join(text.split())  # the report wraps at 100 columns
    assert f"plugin {site / RUNTIME} installed as hicache-async-ack {__version__}" in flat, text
    assert f"entry point {ENTRY_POINT} (group {PLUGIN_GROUP})" in flat
    assert "verdict: ACTIVE (exit 0)" in text
    rc, text = out["lab_command"]
    assert rc == 2 and f"`{runtime_cli.LAB_PROG} upstream-patch`" in text, text


def test_sglangs_loader_calls_the_entry_point_from_the_wheels_files(runtime_alone):
    site, out = runtime_alone
    rc, text = out["probe"]
    assert rc == 0, text[-3000:]
    got = probed(text)
    assert got["lab"] is None  # the project's editable lab stayed out
    assert got["dist"] == str(site)  # metadata: the wheel's, not the editable one
    assert got["entry_points"] == [[ENTRY_POINT.split(" = ")[1], str(site)]]
    assert got["imported_before_load"] is False  # load_plugins() imported it
    assert got["loaded_from"] == str(site / RUNTIME / "sglang_plugin.py")
    assert got["hooked"] == [True, True, True]
    assert "Executed general plugin: hicache_async_ack" in text


def test_the_lab_is_seen_where_it_is_installed(wheels, tmp_path):
    """Negative control of "the lab is not importable": the same probe, in a
    venv made the same way with both wheels, finds the lab in that venv."""
    python, site = make_venv(tmp_path / "venv", [w.path for w in wheels.values()])
    (rc, text) = run_all({"probe": [str(python), "-c", PROBE]})["probe"]
    assert rc == 0, text[-3000:]
    got = probed(text)
    assert got["lab"] == str(site / LAB / "__init__.py")
    assert got["dist"] == str(site)
