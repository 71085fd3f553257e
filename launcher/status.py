"""`vlaunch status`: ask a running launcher over its HTTP status endpoint."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import click

from vlaunch.cache.contract.sockdir import default_socket_dir


def fetch_status(socket_dir: str, url: str) -> dict[str, Any]:
    """The launcher's /status, found through launcher.json in its socket directory."""
    if not url:
        info = Path(socket_dir or default_socket_dir()) / "launcher.json"
        try:
            url = json.loads(info.read_text())["url"]
        except (OSError, ValueError, KeyError):
            raise click.ClickException(f"no running launcher found ({info} is missing); pass "
                                       "--socket-dir or --url") from None
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/status", timeout=5) as resp:
            return json.loads(resp.read())
    except (OSError, ValueError) as exc:
        raise click.ClickException(f"launcher at {url} did not answer: {exc}; is it running? "
                                   "(a launcher killed with SIGKILL leaves launcher.json "
                                   "behind)") from None


def format_status(s: dict[str, Any]) -> str:
    """A human table: phase, then one line per rank, then the engine."""
    lines = [f"phase {s['phase']}  caches_ready {s['caches_ready']}  "
             f"engine_ready {s['engine_ready']}",
             f"{'rank':>4} {'state':<10} {'pid':>7} {'device':<8} {'GB':>8} {'leases':>6} "
             f"{'last exit':>9}"]
    for rank, r in sorted(s["ranks"].items(), key=lambda kv: int(kv[0])):
        lines.append(f"{rank:>4} {r['state']:<10} {r['pid'] or '-':>7} {r['device'] or '-':<8} "
                     f"{r['bytes'] / 1e9:>8.2f} {len(r['leases']):>6} "
                     f"{'-' if r['last_exit'] is None else r['last_exit']:>9}")
    if s.get("phase") == "loading" and s.get("total_bytes"):
        lines.append(f"loaded {s['loaded_bytes'] / 1e9:.2f} of {s['total_bytes'] / 1e9:.2f} GB "
                     "(ranks that have started reading)")
    e = s.get("engine")
    if e:
        lines.append(f"engine {e['state']}  pid {e['pid']}  restarts {e['restarts']}  "
                     f"hangs {e.get('hangs', 0)}  last exit {e['last_exit']}")
        if e.get("failing"):  # docs/health.md: hung after --engine-unhealthy-after of this
            lines.append(f"engine failing: {', '.join(e['failing'])} for "
                         f"{e.get('unhealthy_for', 0):.1f} s")
        for rank, source in sorted((e.get("weights") or {}).items()):
            if source != "cache":  # docs/swap.md: it serves weights it loaded elsewhere
                lines.append(f"engine: rank {rank}'s weights {source}")
    for rank, r in sorted(s["ranks"].items(), key=lambda kv: int(kv[0])):
        changed = (r.get("checkpoint") or {}).get("changed")
        if changed:  # docs/integrity.md: new engines get a mismatch until the rank restarts
            lines.append(f"rank {rank}: checkpoint changed on disk since loaded: "
                         f"{', '.join(changed)}")
        copies = r.get("copies") or {}
        if copies.get("in_flight"):  # docs/modes.md: a GPU rank makes copy-mode engines' copies
            lines.append(f"rank {rank}: making {copies['in_flight']} copy-mode engine "
                         f"copies ({copies.get('bytes', 0) / 1e9:.2f} GB of device memory)")
    sw = s.get("swap")
    if sw:  # docs/swap.md: which weights serve, and a swap in progress
        what = f"published {sw['label']!r}" if sw.get("label") else \
            sw.get("model") or (s.get("launcher") or {}).get("model", "")
        lines.append(f"weights version {sw['version']}: {what}")
        if sw.get("state", "none") != "none":
            mode = sw.get("mode") or "mode not chosen yet"
            lines.append(f"swap to version {sw['target_version']} ({mode}): "
                         f"{sw['state'].replace('_', ' ')}")
    lines += memory_lines(s.get("memory"))
    if s.get("first_failure"):
        f = s["first_failure"]
        lines.append(f"first failure: rank {f['rank']} pid {f['pid']}: {f['description']}")
    return "\n".join(lines)


def memory_lines(mem: dict[str, Any] | None) -> list[str]:
    """One line per child of the `memory` sample (docs/memory.md), and one per GPU."""
    if not mem:
        return []
    gb = 1e9
    children = [(f"rank {slot}", e) for slot, e in sorted((mem.get("ranks") or {}).items(),
                                                           key=lambda kv: int(kv[0]))]
    children += [(role, mem[role]) for role in ("engine", "standby") if mem.get(role)]
    lines = []
    for who, e in children:
        device = "absent" if e.get("device_bytes") is None else f"{e['device_bytes'] / gb:.2f} GB"
        lines.append(f"memory {who:<8} rss {e['rss'] / gb:.2f} GB  uss {e['uss'] / gb:.2f} GB  "
                     f"pss {e['pss'] / gb:.2f} GB  device {device}")
    for d in mem.get("devices") or []:
        lines.append(f"gpu {d['index']} {d['uuid']}: used {d['used_bytes'] / gb:.2f} of "
                     f"{d['total_bytes'] / gb:.2f} GB, vlaunch {d['vlaunch_bytes'] / gb:.2f} GB")
    if mem.get("device_absent"):
        lines.append(f"device figures absent: {mem['device_absent']}")
    return lines
