"""``python -m tests.faults``: the long fault-injection run, and its figures.

Runs the kill campaign, the rank, disk and attempt fault scenarios (with the rescue
race) and the protocol fuzzer with large numbers, prints a Markdown table of what
happened, writes the raw results as JSON, and with ``--write-doc`` regenerates the
figures section of docs/reliability.md. The exit status is 1 if any campaign found a
violation. ``scripts/faults`` wraps it.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

from tests.faults.harness import Result, set_stateless

CAMPAIGNS = ("kill", "ranks", "disk", "attempts", "fuzz")
STATELESS = ("kill", "ranks", "attempts")
"""The campaigns ``--stateless`` runs: those whose daemons are restarted under a job."""


def _progress(message: str) -> None:
    sys.stderr.write(f"[{time.strftime('%H:%M:%S')}] {message}\n")
    sys.stderr.flush()


def _run(name: str, args: argparse.Namespace, workdir: Path) -> Result:
    if name == "kill":
        from tests.faults.kill import run_kill_campaign

        return run_kill_campaign(workdir, args.kill_trials, seed=args.seed, progress=_progress)
    if name == "ranks":
        from tests.faults.ranks import run_rank_faults

        return run_rank_faults(workdir, args.rounds, progress=_progress)
    if name == "disk":
        from tests.faults.disk import run_disk_faults

        return run_disk_faults(workdir, args.rounds, progress=_progress)
    if name == "attempts":
        from tests.faults.attempts import run_attempt_faults

        return run_attempt_faults(
            workdir, args.rounds, args.race_trials, seed=args.seed, progress=_progress
        )
    from tests.faults.fuzz import run_fuzz_campaign

    return run_fuzz_campaign(workdir, args.fuzz_frames, seed_=args.seed, progress=_progress)


def main(argv: list[str] | None = None) -> int:
    """Run the campaigns; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m tests.faults", description=__doc__)
    parser.add_argument("--kill-trials", type=int, default=500, metavar="N")
    parser.add_argument("--fuzz-frames", type=int, default=100_000, metavar="N")
    parser.add_argument("--race-trials", type=int, default=500, metavar="N")
    parser.add_argument("--rounds", type=int, default=1, help="repetitions of each scenario")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default=",".join(CAMPAIGNS), help="e.g. kill,fuzz")
    parser.add_argument(
        "--stateless",
        action="store_true",
        help="start every daemon run on an empty state directory (kill, ranks, attempts)",
    )
    parser.add_argument("--json", type=Path, help="raw results (default: a temp dir)")
    parser.add_argument("--write-doc", type=Path, metavar="MD", help="e.g. docs/reliability.md")
    args = parser.parse_args(argv)
    only = [c for c in args.only.split(",") if c]
    unknown = sorted(set(only) - set(CAMPAIGNS))
    if unknown:
        parser.error(f"unknown campaigns {unknown}; choose from {', '.join(CAMPAIGNS)}")
    if args.stateless:
        # The disk campaign is about the journal's own disk; fuzzing has no daemon runs.
        only = [c for c in only if c in STATELESS]
        set_stateless(True)
    # torch's notices about single-process loads describe the harness, not a finding.
    warnings.filterwarnings("ignore", category=UserWarning, module="torch")

    from tests.faults import report

    info = report.machine()
    if not info["root"]:
        _progress("not root: the disk campaign's tmpfs mounts will be skipped")
    results: list[Result] = []
    raw = args.json or Path(tempfile.mkdtemp(prefix="ckptd-faults-")) / "figures.json"
    raw.parent.mkdir(parents=True, exist_ok=True)
    _progress(f"raw results: {raw}")
    scratch = Path(tempfile.mkdtemp(prefix="ckf-", dir="/tmp"))  # short: socket paths
    try:
        for name in only:
            _progress(f"{name}: starting")
            workdir = scratch / name
            workdir.mkdir()
            try:
                results.append(_run(name, args, workdir))
            except Exception as exc:  # a harness failure is reported, not lost with the rest
                _progress(f"{name}: the campaign itself failed:\n{traceback.format_exc()}")
                results.append(Result(name, violations=[f"the campaign itself failed: {exc!r}"]))
            _progress(f"{name}: {len(results[-1].violations)} violations")
            # Written after each campaign, so a later one that hangs loses nothing.
            data = report.to_json(results, info, sys.argv)
            raw.write_text(json.dumps(data, indent=2, default=str))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    command = shlex.join(["python", "-m", "tests.faults", *(argv or sys.argv[1:])])
    section = report.render(results, info, command)
    sys.stdout.write(section)
    if args.write_doc is not None:
        name = "figures-stateless" if args.stateless else "figures"
        report.replace_section(args.write_doc, section, name)
        _progress(f"figures written to {args.write_doc}")
    return 1 if any(r.violations for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
