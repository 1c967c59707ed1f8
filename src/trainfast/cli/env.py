"""`trainfast env`: check this machine's training setup and print a block to paste into bug reports."""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.table import Table
from rich.text import Text

from trainfast.envcheck import bug_report_block, environment

EXAMPLES = """examples:
  trainfast env                 # a table of checks, then a block to paste into bug reports
  trainfast env --json | jq '.checks[] | select(.status != "ok")'

Statuses: ok; info (for the record); warn (slower or fragile, the fix column says what to change);
fail (will break, e.g. /dev/shm too small for the loader workers).
The JSON has python, torch, cuda_available, cpu_count, cpu_affinity, cgroup_cpu_limit, memory_bytes,
shm_bytes, gpus (index, name, capability, memory_bytes) and checks (name, status, detail, fix).
Exit code: 0, also with warnings (the checks say what to fix).
"""
STYLES = {"ok": "green", "info": "cyan", "warn": "yellow", "fail": "bold red"}


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("env", help="check CPUs, shared memory, open files and CUDA settings; print a bug-report block",
                       description="Check this machine's training setup (CPUs, /dev/shm, open-files limit, CUDA, "
                                   "TF32, NVML) and print a block to paste into bug reports.",
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the environment and checks as JSON on stdout")
    p.set_defaults(run=run, command_parser=p)


def render_checks(checks: list[dict[str, str]]) -> Table:
    table = Table(title="trainfast env")
    for column in ("check", "status", "detail", "fix"):
        table.add_column(column, overflow="fold")
    for check in checks:
        status = check["status"]
        table.add_row(Text(check["name"]), Text(status, style=STYLES.get(status, "")), Text(check["detail"]),
                      Text(check.get("fix", "")))
    return table


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    env = environment()
    if args.json:
        print(json.dumps(env, indent=2, default=str))
        return 0
    Console().print(render_checks(env["checks"]))
    print("\nPaste this into bug reports:\n")
    print(bug_report_block(env))
    return 0
