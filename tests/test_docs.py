"""The operator documentation: it builds, its examples parse and run, and it matches the code.

What is checked against the code: the exit-status table (`vlaunch exit-codes --json`), the
configuration reference (the click command), the systemd units (exit statuses, timeouts, the
notify sequence of a real `vlaunch run` started with each unit's ExecStart=), and the
troubleshooting tables (every user-facing error and warning string, both directions).
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest
import tomllib
import yaml

from vlaunch.cache.contract.exitcodes import CONFIG_ERROR_STATUSES
from vlaunch.cache.contract.fingerprint import FIELDS
from vlaunch.launcher.cli import run as run_command
from vlaunch.launcher.core import EXTEND_BY

from .conftest import eventually, free_port
from .test_launcher import ENGINE

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
UNITS = ROOT / "units"
CODE_DIRS = (ROOT / "cache", ROOT / "launcher")
PAGES = sorted(DOCS.glob("*.md"))
MARKDOWN = [*PAGES, ROOT / "README.md"]
SNIPPET = re.compile(r'^\s*--8<-- "([^"]+)"\s*$')
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (vlaunch(?:-cache|-engine)?\[)")
SWEEP_S = 5.0  # the launcher's final psutil sweep waits up to this long after a stop

# --------------------------------------------------------------------------- markdown


def fenced_blocks(path: Path) -> list[tuple[str, str]]:
    """(language, body) of each fenced code block, with snippet lines expanded."""
    blocks, lang, body, fence = [], "", [], ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not fence and stripped.startswith("```"):
            fence, lang, body = stripped[:3], stripped[3:].strip(), []
        elif fence and stripped == fence:
            blocks.append((lang, "\n".join(body) + "\n"))
            fence = ""
        elif fence:
            m = SNIPPET.match(line)
            body.append((ROOT / m.group(1)).read_text() if m else line)
    return blocks


def split_row(line: str) -> list[str]:
    """The cells of a markdown table row; pipes inside backticks do not split."""
    cells, cell, code = [], "", False
    for ch in line.strip().strip("|"):
        if ch == "`":
            code = not code
        if ch == "|" and not code:
            cells.append(cell.strip())
            cell = ""
        else:
            cell += ch
    return [*cells, cell.strip()]


def tables(path: Path) -> list[list[list[str]]]:
    """Every table in a page: a header row, then the body rows (separator dropped)."""
    out: list[list[list[str]]] = []
    current: list[list[str]] = []
    for line in [*path.read_text().splitlines(), ""]:
        if line.lstrip().startswith("|"):
            row = split_row(line)
            if not all(set(c) <= set("-: ") for c in row):
                current.append(row)
        elif current:
            out.append(current)
            current = []
    return out


def table(path: Path, *header: str) -> list[list[str]]:
    """The one table of a page whose header cells begin with `header`."""
    found = [t for t in tables(path) if t[0][:len(header)] == list(header)]
    assert len(found) == 1, f"{path.name}: expected one table headed {header!r}"
    return found[0]


def code_spans(text: str) -> list[str]:
    return re.findall(r"`([^`]+)`", text)


def test_site_builds_strict(tmp_path: Path) -> None:
    """mkdocs --strict: every page in the nav, every link and anchor resolves, snippets exist."""
    for module in ("mkdocs", "material", "pymdownx"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed (pip install -e '.[test]')")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                        str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert config["validation"]["anchors"] == "warn"  # with --strict: a broken anchor fails


def test_markdown_lint() -> None:
    if importlib.util.find_spec("pymarkdown") is None:
        pytest.skip("pymarkdownlnt is not installed (pip install -e '.[test]')")
    r = subprocess.run([sys.executable, "-m", "pymarkdown", "--config", ".pymarkdown.json",
                        "scan", *map(str, MARKDOWN)], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_yaml_blocks_and_examples_parse() -> None:
    docs = [(p.name, body) for p in MARKDOWN for lang, body in fenced_blocks(p)
            if lang in ("yaml", "yml")]
    files = [(p.name, p.read_text()) for p in sorted((DOCS / "examples").glob("*.yaml"))]
    assert len(files) >= 2 and docs
    for name, text in docs + files:
        assert list(yaml.safe_load_all(text)), name


def test_bash_blocks_parse() -> None:
    bash = shutil.which("bash")
    assert bash
    blocks = [(p.name, body) for p in MARKDOWN for lang, body in fenced_blocks(p)
              if lang in ("bash", "sh")]
    assert blocks
    for name, body in blocks:
        r = subprocess.run([bash, "-n"], input=body, capture_output=True, text=True, timeout=10)
        assert r.returncode == 0, f"{name}:\n{body}\n{r.stderr}"


def test_toml_blocks_name_real_options() -> None:
    """Unknown keys in a --config file are silently ignored: the documented ones must exist."""
    names = {p.name for p in run_command.params}
    blocks = [(p.name, body) for p in MARKDOWN for lang, body in fenced_blocks(p)
              if lang == "toml"]
    assert blocks
    for name, body in blocks:
        data = tomllib.loads(body)
        data = data.get("run", data)
        unknown = {k for k in data if k.replace("-", "_") not in names}
        assert not unknown, f"{name}: {unknown}"


def test_fingerprint_fields_are_documented() -> None:
    text = (DOCS / "how-it-works.md").read_text()
    assert [f for f in FIELDS if f"`{f}`" not in text] == []


# ----------------------------------------------------------------------- exit statuses


def test_exit_status_table_matches_the_code() -> None:
    r = subprocess.run([sys.executable, "-m", "vlaunch.launcher.cli", "exit-codes", "--json"],
                       capture_output=True, text=True, timeout=30, check=True)
    code = [(row["status"], row["name"], row["who"], "yes" if row["retry"] else "no",
             row["meaning"]) for row in json.loads(r.stdout)]
    header, *rows = table(DOCS / "exit-codes.md", "Status")
    assert header[:5] == ["Status", "Name", "Who", "Restart helps", "Meaning"]
    docs = [(int(c[0]), c[1].strip("`"), c[2], c[3], c[4]) for c in rows]
    assert docs == code
    listed = " ".join(map(str, CONFIG_ERROR_STATUSES))
    assert f"RestartPreventExitStatus={listed}`" in (DOCS / "exit-codes.md").read_text()


# ------------------------------------------------------------------------ configuration


def _default(param: click.Option) -> str:
    value = param.default
    if param.is_flag and value is not None:
        return "true" if value else "false"
    if value is None or not isinstance(value, (str, int, float, list, tuple)):
        return "none"
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value))
    if isinstance(value, float):
        return f"{value:g}"
    return '""' if value == "" else str(value)


def test_configuration_reference_matches_the_command() -> None:
    header, *rows = table(DOCS / "configuration.md", "Option", "Environment variable")
    assert header == ["Option", "Environment variable", "Default", "Meaning"]
    by_option = {c[0].strip("`"): c for c in rows}
    options = [p for p in run_command.params if isinstance(p, click.Option)]
    assert sorted(by_option) == sorted(p.opts[0] for p in options)
    for p in options:
        cell = by_option[p.opts[0]]
        assert cell[1] == f"`{p.envvar}`", p.opts
        # the page's rule for TOML keys: "the option names without the dashes" (load_config)
        assert p.name == "config" or p.opts[0][2:].replace("-", "_") == p.name, p.opts
        shown = code_spans(cell[2])[0] if code_spans(cell[2]) else cell[2]
        assert shown == _default(p), (p.opts, shown, _default(p))


def test_configuration_reference_lists_the_cache_ranks_options() -> None:
    from vlaunch.cache.contract.launch import rank_command

    header, *rows = table(DOCS / "configuration.md", "Rank option", "Environment variable")
    assert header == ["Rank option", "Environment variable", "Default", "Meaning"]
    by_option = {c[0].strip("`"): c for c in rows}
    options = [p for p in rank_command("cache", lambda a: a).params
               if isinstance(p, click.Option)]
    assert sorted(by_option) == sorted(p.opts[0] for p in options)
    for p in options:
        cell = by_option[p.opts[0]]
        assert cell[1] == (f"`{p.envvar}`" if p.envvar else "—"), p.opts
        assert code_spans(cell[2])[0] == _default(p), (p.opts, cell[2], _default(p))
        assert cell[3] == p.help, f"{p.opts[0]}: the Meaning is the option's help (launch.py)"


def test_configuration_reference_lists_every_setting_as_the_registry_has_it() -> None:
    """docs/configuration.md's settings table is the registry's (contract/settings.py): every
    variable, its kind, its default and its meaning, in order."""
    from vlaunch.cache.contract.settings import REGISTRY

    header, *rows = table(DOCS / "configuration.md", "Variable", "Kind")
    assert header == ["Variable", "Kind", "Default", "Meaning"]
    assert rows == [[f"`{s.name}`", s.kind, s.shown, s.doc] for s in REGISTRY.values()]


# ----------------------------------------------------------------- compose and kubernetes


def _flag(args: list[str], name: str) -> str | None:
    """The value of `--name=value` or `--name value` in an argument list."""
    for i, arg in enumerate(args):
        if arg.startswith(f"{name}="):
            return arg.split("=", 1)[1]
        if arg == name and i + 1 < len(args):
            return args[i + 1]
    return None


def test_compose_gates_the_engine_on_the_caches() -> None:
    compose = yaml.safe_load((DOCS / "examples" / "compose.yaml").read_text())
    cache, engine = compose["services"]["cache"], compose["services"]["engine"]
    cmd = cache["command"]
    assert cmd[:2] == ["vlaunch", "run"] and "--" not in cmd  # caches only
    port, sockdir = _flag(cmd, "--health-port"), _flag(cmd, "--socket-dir")
    assert port and int(port) > 0 and sockdir
    check = " ".join(cache["healthcheck"]["test"])
    assert f":{port}/readyz" in check or f":{port}/startupz" in check
    assert engine["depends_on"]["cache"]["condition"] == "service_healthy"
    assert engine["environment"]["VLAUNCH_SOCKET_DIR"] == sockdir
    mounts = [m for m in cache["volumes"] if m.endswith(f":{sockdir}")]
    assert mounts and mounts[0] in engine["volumes"]
    assert cache["user"] == engine["user"]
    gpus = yaml.safe_load((DOCS / "examples" / "compose.gpus.yaml").read_text())["services"]
    assert gpus["cache"]["deploy"] == gpus["engine"]["deploy"]  # the same GPUs
    assert gpus["cache"]["environment"] == gpus["engine"]["environment"] == {
        "VLAUNCH_DEVICE": "cuda"}
    assert "--no-fallback" in engine["command"]
    for service in (cache, engine):
        assert "pid" not in service and "ipc" not in service
    # tini in front of every command: the image's entrypoint (docs/examples/Dockerfile)
    dockerfile = (DOCS / "examples" / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["tini", "--"]' in dockerfile.splitlines()
    text = (DOCS / "docker.md").read_text()
    for word in ("`cache`", "`engine`", "service_healthy", "/readyz", "--pid=host", "--ipc=host",
                 "invalid device context"):
        assert word in text, word


def test_the_docs_include_the_recipes_ci_runs() -> None:
    """docker.md shows the files .ci/containers.sh runs (snippets, not copies); the scripts
    parse."""
    text = (DOCS / "docker.md").read_text()
    for name in ("Dockerfile", "one-container.sh", "two-containers.sh", "compose.yaml",
                 "compose.gpus.yaml"):
        assert f'--8<-- "docs/examples/{name}"' in text, name
    assert '--8<-- "docs/examples/k8s.yaml"' in (DOCS / "kubernetes.md").read_text()
    for script in (DOCS / "examples").glob("*.sh"):
        r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True,
                           timeout=10)
        assert r.returncode == 0, f"{script.name}: {r.stderr}"


def test_k8s_probes_follow_the_text() -> None:
    docs = list(yaml.safe_load_all((DOCS / "examples" / "k8s.yaml").read_text()))
    pod = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    [container] = pod["containers"]
    argv = [*container["command"], *container["args"]]
    assert argv[:2] == ["vlaunch", "run"] and "--" in argv  # caches and engine, one container
    launcher = argv[:argv.index("--")]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert int(_flag(launcher, "--health-port") or 0) == ports["vlaunch"]
    assert _flag(launcher, "--health-host") == "0.0.0.0"
    probe = {k: container[k]["httpGet"] for k in ("startupProbe", "livenessProbe",
                                                  "readinessProbe")}
    assert probe["startupProbe"] == {"path": "/startupz", "port": "vlaunch"}
    assert probe["livenessProbe"] == {"path": "/livez", "port": "vlaunch"}
    # readiness on the launcher's /readyz: false while the engine restarts, hangs or is replaced
    assert probe["readinessProbe"] == {"path": "/readyz", "port": "vlaunch"}
    assert int(_flag(argv[argv.index("--"):], "--port") or 0) == ports["http"]
    # hang detection: a liveness request to the engine's port, and a hang deadline that is on
    engine_port = str(ports["http"])
    liveness = next(a for a in launcher if a.startswith("--engine-liveness-request="))
    assert f"127.0.0.1:{engine_port}/" in liveness
    assert float(_flag(launcher, "--engine-unhealthy-after") or 120) > 0
    stop = float(_flag(launcher, "--stop-timeout") or 30)
    assert pod["terminationGracePeriodSeconds"] > stop + SWEEP_S
    text = (DOCS / "kubernetes.md").read_text()
    for word in ("startupProbe", "livenessProbe", "readinessProbe", "/startupz", "/livez",
                 "/readyz", "--engine-liveness-request", "terminationGracePeriodSeconds"):
        assert word in text, word


# ----------------------------------------------------------------------------- systemd

UNIT_FILES = ["vlaunch@.service", "vlaunch-cache@.service"]


def unit_settings(text: str) -> dict[str, list[str]]:
    """Every `Key=value` of a unit file (any section), values in order."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def seconds(value: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(s|sec|min|m)?", value)
    assert m, value
    return float(m.group(1)) * (60 if m.group(2) in ("min", "m") else 1)


def stop_timeout(exec_start: str) -> float:
    return float(_flag(shlex.split(exec_start), "--stop-timeout") or 30)


@pytest.mark.parametrize("name", UNIT_FILES)
def test_unit_settings(name: str) -> None:
    s = unit_settings((UNITS / name).read_text())
    assert s["Type"] == ["notify"] and s["NotifyAccess"] == ["main"]
    assert seconds(s["WatchdogSec"][-1]) > 0
    assert s["Restart"] == ["on-failure"] and s["KillMode"] == ["mixed"]
    assert set(s["RestartPreventExitStatus"][-1].split()) == set(map(str, CONFIG_ERROR_STATUSES))
    assert seconds(s["TimeoutStartSec"][-1]) >= EXTEND_BY
    assert seconds(s["TimeoutStopSec"][-1]) >= stop_timeout(s["ExecStart"][-1]) + SWEEP_S
    assert s["RuntimeDirectoryMode"] == ["0700"]
    assert ("-- $ENGINE_COMMAND" in s["ExecStart"][-1]) == (name == "vlaunch@.service")
    text = (DOCS / "systemd.md").read_text()
    for key in s:  # the docs explain each line
        assert f"`{key}=" in text, key


def test_drop_in_example_keeps_the_stop_timeouts_in_order() -> None:
    s = unit_settings((UNITS / "vlaunch@.service.d" / "override.conf.example").read_text())
    assert s["ExecStart"][0] == ""  # clears the template's ExecStart first
    assert seconds(s["TimeoutStopSec"][-1]) >= stop_timeout(s["ExecStart"][-1]) + SWEEP_S


def test_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    """Every unit (with the drop-in example applied), its vlaunch path pointed at ours."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (.ci/run installs systemd)")
    binary = shutil.which("vlaunch") or str(Path(sys.executable).with_name("vlaunch"))
    assert os.access(binary, os.X_OK), binary
    units = [*UNITS.glob("*.service"), *UNITS.glob("*.socket"),
             *(DOCS / "examples").glob("*.service")]
    for unit in units:
        (tmp_path / unit.name).write_text(re.sub(r"/\S+/bin/vlaunch\b", binary, unit.read_text()))
    (tmp_path / "vlaunch@.service.d").mkdir()
    drop_in = (UNITS / "vlaunch@.service.d" / "override.conf.example").read_text()
    (tmp_path / "vlaunch@.service.d" / "override.conf").write_text(
        re.sub(r"/\S+/bin/vlaunch\b", binary, drop_in))
    r = subprocess.run([analyze, "verify", *(f"./{u.name}" for u in units)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, "SYSTEMD_UNIT_PATH": f"{tmp_path}:"})
    assert r.returncode == 0 and not (r.stdout + r.stderr).strip(), r.stdout + r.stderr




def systemd_argv(exec_start: str, env: dict[str, str]) -> list[str]:
    """ExecStart= as systemd splits it: $VAR splits at whitespace, ${VAR} stays one word."""
    argv: list[str] = []
    for word in shlex.split(exec_start):
        if re.fullmatch(r"\$\w+", word):
            argv += env.get(word[1:], "").split()
        else:
            argv.append(re.sub(r"\$\{(\w+)\}", lambda m: env.get(m.group(1), ""), word))
    return argv


@pytest.mark.parametrize("name", UNIT_FILES)
def test_launcher_run_as_the_unit_runs_it(name: str, tmp_path: Path, llama_ckpt: Path) -> None:
    """The unit's ExecStart=, Environment=, EnvironmentFile=; a socket stands in for systemd."""
    specifiers = {"%E": str(tmp_path / "etc"), "%t": str(tmp_path / "run"), "%i": "t"}
    text = (UNITS / name).read_text()
    for spec, value in specifiers.items():
        text = text.replace(spec, value)
    s = unit_settings(text)
    conf = tmp_path / "etc" / "vlaunch"
    conf.mkdir(parents=True)
    (conf / "t.toml").write_text(f'model = "{llama_ckpt}"\nengine-ready = "notify"\n'
                                 "health-port = 0\n")
    (tmp_path / "engine.py").write_text(ENGINE)
    (conf / "t.env").write_text(f"ENGINE_COMMAND={sys.executable} {tmp_path / 'engine.py'}\n")
    runtime = tmp_path / "run" / s["RuntimeDirectory"][0]
    runtime.mkdir(parents=True, mode=0o700)  # what RuntimeDirectory=, RuntimeDirectoryMode= do
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLAUNCH_")}
    for assignment in s.get("Environment", []):
        key, _, value = assignment.partition("=")
        env[key] = value
    for line in (conf / "t.env").read_text().splitlines():
        key, _, value = line.partition("=")
        env[key] = value
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify.sock"))
    notify.settimeout(0.2)
    env["NOTIFY_SOCKET"] = str(tmp_path / "notify.sock")
    env["WATCHDOG_USEC"] = str(int(seconds(s["WatchdogSec"][-1]) * 1_000_000))
    argv = systemd_argv(s["ExecStart"][-1], env)
    assert argv[0].endswith("/vlaunch") and argv[1] == "run"
    argv = [sys.executable, "-m", "vlaunch.launcher.cli", *argv[1:]]
    log = (tmp_path / "launcher.log").open("wb")
    proc = subprocess.Popen(argv, env=env, stderr=log)
    messages: list[str] = []

    def wait_for(field: str, timeout: float = 60) -> int:
        def first() -> int | None:
            with contextlib.suppress(TimeoutError):  # the receive's timeout paces the poll
                messages.append(notify.recv(4096).decode())
            found = [i for i, m in enumerate(messages) if field in m.splitlines()]
            assert found or proc.poll() is None, (tmp_path / "launcher.log").read_text()
            return found[0] + 1 if found else None  # + 1: index 0 is an answer too

        return eventually(first, timeout, what=lambda: f"{field} in {messages}",
                          interval=0) - 1

    try:
        ready = wait_for("READY=1")
        assert any(m.startswith("EXTEND_TIMEOUT_USEC=") or "\nEXTEND_TIMEOUT_USEC=" in m
                   for m in messages[:ready]), messages
        wait_for("WATCHDOG=1")
        proc.send_signal(signal.SIGTERM)
        stopping = wait_for("STOPPING=1")
        assert stopping > ready
        assert proc.wait(60) == 0, (tmp_path / "launcher.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        notify.close()
        log.close()


# --------------------------------------------------------------------------- quick start


def _normalise(line: str) -> str:
    """A log line without its timestamp, with numbers and paths replaced by placeholders."""
    line = LOG_LINE.sub(r"\1", line.strip())
    line = re.sub(r"(?<![\w-])[~/]\S*", "PATH", line)
    return re.sub(r"\d+(?:\.\d+)?", "N", line)


def _http(url: str, body: bytes | None = None) -> Any:
    with urllib.request.urlopen(url, data=body, timeout=5) as r:
        return json.loads(r.read())


@pytest.mark.slow  # ~18 s of real launcher and engine: with the other operator runs
def test_quickstart_runs_for_real(tmp_path: Path, demo_ckpt: Path) -> None:
    """Step 2-4 of the quick start: `vlaunch run` as written, generate, kill the engine, stop.

    Step 1, `vlaunch demo`, runs in tests/test_demo.py.
    """
    page = DOCS / "quickstart.md"
    bash = [body for lang, body in fenced_blocks(page) if lang == "bash"]
    assert any("vlaunch demo" in b for b in bash)
    [command] = [b.replace("\\\n", " ").strip() for b in bash if b.startswith("vlaunch run")]
    port = free_port()
    assert "--port 8000" in command
    command = command.replace("--port 8000", f"--port {port}")
    home, xdg = tmp_path / "home", tmp_path / "xdg"
    home.mkdir()
    xdg.mkdir(mode=0o700)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("VLAUNCH_", "XDG_", "NOTIFY_SOCKET", "WATCHDOG_"))}
    env.update(HOME=str(home), XDG_RUNTIME_DIR=str(xdg),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")
    # step 1's checkpoint where `vlaunch demo` leaves it (hard links to the one made once)
    shutil.copytree(demo_ckpt, home / ".cache" / "vlaunch" / "demo-llama", copy_function=os.link)
    log = tmp_path / "launcher.log"
    with log.open("wb") as err:
        proc = subprocess.Popen(["bash", "-c", f"exec {command}"], env=env, stderr=err)
    try:
        status_url = ""

        def serving() -> dict[str, Any] | None:
            nonlocal status_url
            assert proc.poll() is None, log.read_text()
            with contextlib.suppress(OSError, ValueError, KeyError):
                if not status_url:
                    info = json.loads((xdg / "vlaunch" / "launcher.json").read_text())
                    status_url = info["url"] + "/status"
                snap = _http(status_url)
                if snap["phase"] == "serving" and snap["engine_ready"]:
                    return snap
            return None

        def status() -> dict[str, Any]:
            return eventually(serving, 90, what=lambda: f"serving\n{log.read_text()}",
                              interval=0.2)

        first = status()["engine"]["pid"]
        out = _http(f"http://127.0.0.1:{port}/generate",
                    json.dumps({"tokens": [1, 2, 3], "max_new_tokens": 4}).encode())
        assert len(out["tokens"]) == 4
        os.kill(first, signal.SIGKILL)
        eventually(lambda: status()["engine"]["restarts"] >= 1, 90, what="a restart",
                   interval=0.2)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    real = {_normalise(line) for line in log.read_text().splitlines()}
    shown = [line for lang, body in fenced_blocks(page) if lang == "text"
             for line in body.splitlines() if LOG_LINE.match(line)]
    assert len(shown) >= 10
    missing = [line for line in shown if _normalise(line) not in real]
    assert not missing, "\n".join(missing) + "\n--- real log ---\n" + log.read_text()


# ----------------------------------------------------------------------- troubleshooting

HOLE = "\x00"
MIN_KEY = 15
MAX_KEY = 60
PERCENT = re.compile(r"%[-#0 +]*(?:\d+|\*)?(?:\.\d+)?[sdifrxXoegc]")
# Strings that never reach an operator: control flow caught in the same module, and checks
# that only a bug in vlaunch itself can trip (they end in exit status 70, "please report").
INTERNAL = {
    "index needs validation": "checkpoint.checkpoint_identity: falls back to full validation",
    "header too large": "checkpoint.checkpoint_identity: falls back to full validation",
    "not a supervisor event": "launcher.core: an executor bug",
    "Started must come first, exactly once": "launcher.core: an executor bug",
    "engine event, but this launcher runs no engine": "launcher.core: an executor bug",
    "no standby was asked for": "launcher.core: an executor bug",
    "is not in its table": "launcher.core: a move off a state table (model.py), a core bug",
    "a replicated slice has exactly one part": "cache.plan: an invariant of SliceSpec",
    "cannot split shape": "cache.plan: an invariant of SliceSpec, after plan validation",
    "max_bytes must be >= 1, got": "cache.plan: an internal argument",
    "slab size must be >= 0, got": "cache.slabs_cuda: an internal argument",
    "a pre-encoded frame carries no fds": "contract.wire: a rank handler bug",
    "bytes into a slab of": "rank.staging.copy_bytes: both sides come from one manifest",
    "has nothing staged for version": "rank.swap: the launcher sends steps in order",
}


def _template(node: ast.expr, percent: bool = False) -> str | None:
    """A string expression's literal text, each placeholder replaced by HOLE."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return PERCENT.sub(HOLE, node.value) if percent else node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else HOLE for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _template(node.left, percent), _template(node.right, percent)
        if left is None and right is None:
            return None
        return (HOLE if left is None else left) + (HOLE if right is None else right)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
        return _template(node.left, percent=True)
    return None


def _key(template: str) -> str | None:
    """The first literal run of at least MIN_KEY characters, cut to MAX_KEY at a word."""
    for segment in template.split(HOLE):
        text = segment.lstrip(" :;,.)]").rstrip(" :;,.([")
        if len(text) >= MIN_KEY:
            if len(text) > MAX_KEY:
                text = text[:MAX_KEY].rsplit(" ", 1)[0].rstrip(" :;,.([")
            return text
    return None


def _message_args(node: ast.AST, folder: str) -> Iterator[tuple[ast.expr, bool]]:
    """The message arguments of a user-facing raise or log call, with their %-format flag."""
    if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
        func = node.exc.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if name.endswith("Error") or name in ("ClickException", "BadParameter"):
            yield from ((a, False) for a in [*node.exc.args, *(k.value for k in
                                                                node.exc.keywords)])
    elif isinstance(node, ast.Call):
        func = node.func
        if (isinstance(func, ast.Attribute) and func.attr in ("warning", "error", "exception")
                and isinstance(func.value, ast.Name) and func.value.id == "log" and node.args):
            yield node.args[0], True
        elif (isinstance(func, ast.Name) and func.id == "Log" and len(node.args) > 1
              and isinstance(node.args[0], ast.Constant)
              and node.args[0].value in ("WARNING", "ERROR")):
            yield node.args[1], False
    elif (isinstance(node, ast.Assign) and folder == "core"
          and any(isinstance(t, ast.Name) and t.id in ("what", "why") for t in node.targets)):
        yield node.value, False  # launcher.core builds its ERROR lines and exit reasons so


def _error_class_messages(tree: ast.Module) -> Iterator[ast.expr]:
    """Messages that error classes build themselves: super().__init__(...) in *Error."""
    for cls in ast.walk(tree):
        if isinstance(cls, ast.ClassDef) and cls.name.endswith("Error"):
            for node in ast.walk(cls):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr == "__init__" and node.args):
                    yield node.args[0]


def code_templates() -> Iterator[tuple[str, str, str]]:
    """(key, template, where) of every user-facing error and warning string in the code."""
    for path in sorted(p for d in CODE_DIRS for p in d.rglob("*.py")):
        tree = ast.parse(path.read_text())
        args = [(a, pct) for n in ast.walk(tree) for a, pct in _message_args(n, path.parent.name)]
        args += [(a, False) for a in _error_class_messages(tree)]
        for arg, percent in args:
            template = _template(arg, percent)
            key = _key(template) if template is not None else None
            if key is not None:
                yield key, template, f"{path.parent.name}/{path.name}:{arg.lineno}"


def code_messages() -> dict[str, str]:
    """Key -> where, for every user-facing error and warning string in cache/ and launcher/."""
    found: dict[str, str] = {}
    for key, _, where in code_templates():
        found.setdefault(key, where)
    return found


def code_literals() -> list[str]:
    """Every literal run of text in cache/ and launcher/ (placeholders split them)."""
    out = []
    for path in sorted(p for d in CODE_DIRS for p in d.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Constant, ast.JoinedStr)):
                template = _template(node, percent=True)
                if template:
                    out += template.split(HOLE)
    return out


# Templates that only build a larger line: a prefix around the error they name (that error's
# own entry matches the line), or a part the core completes before it logs.
WRAPPERS = {
    "swap to version": "rank.swap: `rank R: swap to version V: <the error>`",
    "exited during the swap to version": "launcher.core.swap: the first half of two messages",
}
GENERATED = ("<!-- generated: vlaunch troubleshoot --markdown (from "
             "launcher/troubleshooting.toml) -->")


def test_troubleshooting_page_is_rendered_from_its_source() -> None:
    """docs/troubleshooting.md after its introduction is `vlaunch troubleshoot --markdown`."""
    from vlaunch.launcher import troubleshoot

    page = (DOCS / "troubleshooting.md").read_text()
    assert GENERATED in page, "docs/troubleshooting.md lost its generated marker"
    body = page.split(GENERATED, 1)[1].lstrip("\n")
    assert body == troubleshoot.markdown(), (
        "docs/troubleshooting.md is stale: edit launcher/troubleshooting.toml, then put "
        "`vlaunch troubleshoot --markdown` after the marker")


def test_vlaunch_troubleshoot_finds_every_message_as_the_code_prints_it() -> None:
    """Each user-facing message, its placeholders filled as a log line would have them, is
    looked up by `vlaunch troubleshoot` (the entry's runs, in order, are in the line)."""
    from vlaunch.launcher import troubleshoot

    missed = {}
    templates = list(code_templates())
    for key, template, where in templates:
        if key in INTERNAL or key in WRAPPERS:
            continue
        if not troubleshoot.find([template.replace(HOLE, "7")]):
            missed[key] = where
    assert not missed, "no entry matches these as printed (launcher/troubleshooting.toml):\n" \
        + "\n".join(f"  `{k}`  ({w})" for k, w in sorted(missed.items()))
    assert set(WRAPPERS) <= {k for k, _, _ in templates}, "stale WRAPPERS entries"


def test_vlaunch_troubleshoot_reads_a_log_and_prints_each_entry_once() -> None:
    """The command on a real failure's output: a bad option's line, twice, and one line no
    entry matches; each entry once, with the line that matched it and the status's name."""
    bad = subprocess.run([sys.executable, "-m", "vlaunch.launcher.cli", "run", "--model",
                          "/nonexistent", "--engine-ready", "http", "--", "true"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 64, bad.stderr
    line = bad.stderr.strip().splitlines()[-1]
    log = f"{line}\nnothing to see here\n{line}\n"
    r = subprocess.run([sys.executable, "-m", "vlaunch.launcher.cli", "troubleshoot"],
                       input=log, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count(line.strip()[:300]) == 1, r.stdout
    assert "exit 64 (USAGE)" in r.stdout, r.stdout
    none = subprocess.run([sys.executable, "-m", "vlaunch.launcher.cli", "troubleshoot",
                           "nothing to see here"], capture_output=True, text=True, timeout=60)
    assert none.returncode == 0 and not none.stdout
    assert "no troubleshooting entry matches" in none.stderr


def test_troubleshooting_covers_every_message_and_only_real_ones() -> None:
    page = DOCS / "troubleshooting.md"
    keys = [span for t in tables(page) if t[0][0] == "Message"
            for row in t[1:] for span in code_spans(row[0])]
    column = "\n".join(keys)
    messages = code_messages()
    assert not set(INTERNAL) - set(messages), "stale INTERNAL entries"
    undocumented = {k: where for k, where in messages.items()
                    if k not in INTERNAL and k not in column}
    assert not undocumented, "add to docs/troubleshooting.md:\n" + "\n".join(
        f"  `{k}`  ({where})" for k, where in sorted(undocumented.items()))
    literals = code_literals()
    invented = [k for k in keys if not any(k in lit for lit in literals)]
    assert not invented, f"not in the code: {invented}"


def _slug(heading: str) -> str:
    """A heading's anchor as mkdocs makes it (toc's default slugify)."""
    text = re.sub(r"[^\w\s-]", "", re.sub(r"`|\*", "", heading)).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def test_links_into_the_docs_from_outside_them_resolve() -> None:
    """`docs/PAGE.md#ANCHOR` in the code, the units, the benchmarks' results and the README
    names a page and a heading that exist (the site's strict build checks only docs/)."""
    anchors = {p.name: {_slug(line.lstrip("#")) for line in p.read_text().splitlines()
                        if line.startswith("#")} for p in PAGES}
    roots = [ROOT / "cache", ROOT / "launcher", ROOT / "units", ROOT / "benchmarks",
             ROOT / "README.md"]
    files = [f for r in roots for f in ([r] if r.is_file() else r.rglob("*"))
             if f.is_file() and f.suffix in (".py", ".md", ".sh", ".toml", ".service",
                                            ".socket", ".yaml", ".example")]
    broken = []
    for f in files:
        for page, anchor in re.findall(r"docs/([\w.-]+\.md)#([\w-]+)", f.read_text()):
            if anchor not in anchors.get(page, set()):
                broken.append(f"{f.relative_to(ROOT)}: docs/{page}#{anchor}")
    assert not broken, "\n".join(broken)
