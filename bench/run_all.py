"""Run every workload for Orbit and its peers, one system at a time, and tabulate.

    python3 -m bench.run_all                      # all systems, W0..W5, 5 runs each
    python3 -m bench.run_all --quick              # small sizes, 1 run: a few minutes
    python3 -m bench.run_all --systems orbit,procrastinate --workloads W1,W5 --runs 3

Run from the repository root. Creates bench/.venv from bench/requirements.txt on first use (and again when that file
changes); every run happens in a fresh child process of that venv, bounded in time,
and whatever it started is ended afterwards. Results: bench/results/results.json (every
run's metrics, medians and spread, environment, durability settings) and
bench/results/results.md (tables). A later invocation with --systems/--workloads merges
into the same files (same mode only); --fresh starts them over. See bench/README.md.

This file uses the standard library only; it may be started with any Python >= 3.11.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import UTC, datetime
from pathlib import Path

from bench import common
from bench.systems import ALL_WORKLOADS, REGISTRY, REQUIRES, WORKLOAD_TITLES

BENCH_DIR = common.BENCH_DIR

FULL = {
    "mode": "full",
    "tasks": 10_000,
    "workers": 4,
    "capacity": 32,
    "submitters": 16,
    "keys": [1, 10, 100],
    "rate": 50,
    "rate_seconds": 30,
    "lease_seconds": 10,
    "crash_tasks": 32,
    "backlog_small": 1_000,
    "backlog_large": 1_000_000,
    "lease_samples": 200,
    "w0_seconds": 10,
    "key_rate": 20,
    "key_rate_seconds": 30,
}
QUICK = {
    **FULL,
    "mode": "quick",
    "tasks": 1_000,
    "rate_seconds": 10,
    "backlog_large": 20_000,
    "lease_samples": 100,
    "w0_seconds": 3,
    "key_rate_seconds": 10,
}
DEADLINES = {  # seconds per run (the child is killed 60 s after)
    "full": {"W0": 300, "W1": 1200, "W2": 2400, "W3": 300, "W4": 300, "W5": 3600, "W6": 600},
    "quick": {"W0": 120, "W1": 300, "W2": 600, "W3": 150, "W4": 180, "W5": 400, "W6": 180},
}
PACKAGES = [
    "celery", "kombu", "amqp", "redis", "procrastinate", "psycopg", "psycopg-pool", "Django",
    "django-q2", "httpx", "websockets", "mysqlclient",
]  # fmt: skip
PREFERRED_ORDER = [
    # W0
    "commits_per_s", "ceiling_tasks_per_s", "transactions_per_task_grouped",
    "ceiling_tasks_per_s_grouped",
    # W1
    "tasks", "seconds", "tasks_per_s", "frames_per_task", "rounds_per_task", "transactions_per_task",
    "submit_per_s", "latency_p50_ms", "latency_p95_ms",
    "latency_p99_ms", "server_cpu_s_per_1k", "db_cpu_s_per_1k", "client_cpu_s_per_1k",
    "machine_cpu_s_per_1k", "machine_busy_pct", "cpu_bound_tasks_per_s",
    "drain_tasks", "drain_seconds", "drain_tasks_per_s", "drain_frames_per_task", "drain_rounds_per_task",
    "drain_transactions_per_task",
    # W2
    "tasks_per_s_keys1", "keys1_frames_per_task", "keys1_rounds_per_task", "keys1_transactions_per_task",
    "tasks_per_s_keys10", "keys10_frames_per_task", "keys10_rounds_per_task", "keys10_transactions_per_task",
    "tasks_per_s_keys100", "keys100_frames_per_task", "keys100_rounds_per_task",
    "keys100_transactions_per_task", "tasks_per_s_keys10_cap4", "keys10_cap4_holders_max",
    "cap4_within_capacity", "overlap_ok", "overlaps", "tokens_increasing",
    # W3
    "target_rate", "achieved_rate", "worst_window", "min_window", "windows_over_limit",
    "rate_error_pct",
    # W4
    "held_total", "held_running", "first_rerun_s", "relapse_s", "lost", "duplicates",
    "extra_executions", "stale_writes_rejected",
    # W5
    "backlog_small", "backlog_large", "lease_p50_ms_1k", "lease_p99_ms_1k", "lease_p50_ms_1m",
    "lease_p99_ms_1m", "lease_p50_ratio_1m_vs_1k",
    # W6
    "key_rate", "unkeyed_tasks_per_s_alone", "unkeyed_tasks_per_s_with_limited_key", "unkeyed_ratio_with_vs_alone",
    "limited_key_starts", "limited_key_achieved_rate", "limited_key_worst_window",
    "limited_key_started_by_unkeyed_end", "unkeyed_tasks_per_s_with_limited_key_burst4",
    "limited_key_starts_burst4", "limited_key_achieved_rate_burst4", "limited_key_worst_window_burst4",
    "limited_key_started_by_unkeyed_end_burst4",
]  # fmt: skip
RATIO_METRICS = [("W1", "tasks_per_s"), ("W1", "drain_tasks_per_s")]
RESULTS_JSON = common.RESULTS_DIR / "results.json"
RESULTS_MD = common.RESULTS_DIR / "results.md"


def log(message: str) -> None:
    print(f"[{datetime.now().strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- venv


def ensure_venv(skip: bool) -> None:
    """bench/.venv from bench/requirements.txt; rebuilt when the file's hash changes."""
    requirements = BENCH_DIR / "requirements.txt"
    digest = hashlib.sha256(requirements.read_bytes()).hexdigest()
    stamp = common.VENV_DIR / ".requirements.sha256"
    if common.VENV_PYTHON.exists() and stamp.exists() and stamp.read_text().strip() == digest:
        return
    if skip:
        if not common.VENV_PYTHON.exists():
            sys.exit("bench/.venv is missing; run without --skip-setup to create it")
        return
    log(f"creating {common.VENV_DIR} from {requirements.name}")
    if not common.VENV_PYTHON.exists():
        subprocess.run([sys.executable, "-m", "venv", str(common.VENV_DIR)], check=True)
    pip = [str(common.VENV_PYTHON), "-m", "pip", "--disable-pip-version-check", "-q"]
    # cwd = the repository root: the file's `-e ./sdk` names Orbit's SDK from there
    subprocess.run([*pip, "install", "-r", str(requirements)], cwd=common.ROOT, check=True)
    stamp.write_text(digest + "\n")


def clean_scratch(max_age_s: float = 3600) -> None:
    """Drop event logs / worker logs under bench/.work older than an hour."""
    if not common.WORK_DIR.exists():
        return
    cutoff = time.time() - max_age_s
    for path in common.WORK_DIR.iterdir():
        try:
            if path.stat().st_mtime < cutoff:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass


# ---------------------------------------------------------------------------- children


def child(args: list[str], timeout: float, pidfile: Path | None = None) -> tuple[int, str, str]:
    """Run ``python -m bench.run_all <args>`` under the bench venv, from the repository root
    (which ``-m`` puts on the import path), in its own session; kill that session on
    timeout; end every process the child recorded in ``pidfile``."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if pidfile is not None:
        env[common.PIDFILE_ENV] = str(pidfile)
    proc = subprocess.Popen(
        [str(common.VENV_PYTHON), "-m", "bench.run_all", *args],
        cwd=common.ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the child is alive: its group is ours
        out, err = proc.communicate()
        code = -9
        err += f"\nrun_all: killed after {timeout:.0f}s"
    finally:
        if pidfile is not None:
            leftovers = common.reap_registered(pidfile)
            if leftovers:
                err += f"\nrun_all: ended leftover processes {leftovers}"
    return code, out, err


def describe(names: list[str]) -> dict:
    code, out, err = child(["--describe", ",".join(names)], timeout=300)
    if code != 0:
        raise SystemExit(f"describing systems failed:\n{err}")
    return json.loads(out.strip().splitlines()[-1])


def machine_loop_ms() -> float:
    """Milliseconds this machine takes for a fixed pure-Python loop, just
    before a run: a shared virtual machine's speed drifts (here by a third
    from one minute to the next), and each run records the speed it had."""
    began = time.perf_counter()
    total = 0
    for n in range(2_000_000):
        total += n
    return round((time.perf_counter() - began) * 1000, 1)


def run_one(system: str, workload: str, scale: dict) -> dict:
    timeout = scale["deadline_s"] + 60
    speed = machine_loop_ms()
    with tempfile.TemporaryDirectory(prefix="bench-run-") as tmp:
        out_file = Path(tmp) / "result.json"
        pidfile = Path(tmp) / "pids"
        began = time.monotonic()
        code, out, err = child(
            ["--one", system, workload, "--scale", json.dumps(scale), "--out", str(out_file)],
            timeout=timeout,
            pidfile=pidfile,
        )
        elapsed = round(time.monotonic() - began, 1)
        if code == 0 and out_file.exists():
            metrics = json.loads(out_file.read_text())
            metrics["_elapsed_s"] = elapsed
            metrics["machine_loop_ms"] = speed
            if "leftover processes" in err:
                metrics["_warning"] = err.strip().splitlines()[-1]
            return metrics
        tail = "\n".join((err or out).strip().splitlines()[-15:])
        return {"error": tail or f"exit code {code}", "_elapsed_s": elapsed}


# ---------------------------------------------------------------------------- child modes


def child_one(system: str, workload: str, scale: dict, out: Path) -> None:
    from bench.systems import load  # noqa: PLC0415

    impl = load(system)
    metrics = impl.run(workload, scale)
    out.write_text(json.dumps(metrics, default=str))


def child_describe(names: list[str]) -> None:
    from importlib import metadata  # noqa: PLC0415

    from bench.systems import load  # noqa: PLC0415

    systems = {}
    for name in names:
        try:
            impl = load(name)
            systems[name] = {
                "name": impl.NAME,
                "durability": impl.DURABILITY,
                "workloads": list(impl.WORKLOADS),
                "notes": dict(getattr(impl, "NOTES", {}) or {}),
                "config": getattr(impl, "CONFIG", {}) or {},
            }
        except Exception:  # noqa: BLE001
            systems[name] = {"error": traceback.format_exc(limit=3)}
    versions = {}
    for package in PACKAGES:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    print(json.dumps({"systems": systems, "versions": versions, "services": common.service_settings()}, default=str))


# ---------------------------------------------------------------------------- aggregation


def machine_info() -> dict:
    mem_kb = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_kb = int(line.split()[1])
    except OSError:
        pass
    return {
        "cpus": os.cpu_count(),
        "memory_gib": round(mem_kb / 1024 / 1024, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "loadavg_at_start": os.getloadavg(),
    }


def summarize_runs(runs: list[dict]) -> dict:
    good = [r for r in runs if "error" not in r]
    keys: list[str] = []
    for r in good:
        for k, v in r.items():
            if k.startswith("_") or k in ("config", "notes") or isinstance(v, (dict, list)):
                continue
            if k not in keys:
                keys.append(k)
    return {k: common.summarize([r.get(k) for r in good]) for k in keys}


def ratios(results: dict) -> dict:
    out: dict[str, dict[str, float]] = {}
    orbit = results.get("orbit", {})
    for workload, metric in RATIO_METRICS:
        base = orbit.get(workload, {}).get("summary", {}).get(metric, {}).get("median")
        if not base:
            continue
        row = {}
        for system, per in results.items():
            if system == "orbit":
                continue
            peer = per.get(workload, {}).get("summary", {}).get(metric, {}).get("median")
            if peer:
                row[system] = round(base / peer, 2)
        out[f"{workload}.{metric}"] = row
    return out


def fmt_number(x: float) -> str:
    if isinstance(x, bool):
        return "yes" if x else "no"
    x = float(x)
    if x != x:
        return "nan"
    if x == int(x):
        return f"{int(x):,}"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    if abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.3g}" if abs(x) < 1 else f"{x:.2f}"


def fmt_summary(s: dict | None) -> str:
    if not s or not s.get("n"):
        return "–"
    if "median" in s:
        text = fmt_number(s["median"])
        if s["n"] > 1 and s["min"] != s["max"]:
            text += f" ({fmt_number(s['min'])}–{fmt_number(s['max'])})"
        return text
    if "all" in s:
        return ("yes" if s["all"] else ("no" if not s["any"] else "mixed")) + (f" ×{s['n']}" if s["n"] > 1 else "")
    return ", ".join(str(v) for v in s.get("values", []))


def order_metrics(names: set[str]) -> list[str]:
    preferred = [m for m in PREFERRED_ORDER if m in names]
    return preferred + sorted(names - set(preferred))


def render_markdown(data: dict) -> str:
    systems = [s for s in REGISTRY if s in data["results"]]
    lines = [
        f"# Orbit benchmark results ({data['mode']})",
        "",
        f"Generated {data['generated_at']} by `python -m bench.run_all`; scale: "
        + ", ".join(f"{k}={v}" for k, v in data["scale"].items() if k != "mode")
        + f". Machine: {data['machine']['cpus']} CPUs, {data['machine']['memory_gib']} GiB, "
        f"kernel {data['machine']['kernel']}. Cells: median (min–max) over runs; – = not measured.",
        "",
        "## Systems and durability",
        "",
        "| system | durability | workloads |",
        "| --- | --- | --- |",
    ]
    for s in systems:
        info = data["systems"].get(s, {})
        lines.append(
            f"| {s} | {info.get('durability', info.get('error', '?')).replace('|', '/')} | "
            f"{', '.join(info.get('workloads', []))} |"
        )
    services = data.get("services", {})
    if services:
        lines += ["", "Shared services: " + "; ".join(
            f"{name}: " + ", ".join(f"{k}={v}" for k, v in sorted(values.items()))
            for name, values in services.items()
        )]  # fmt: skip
    for workload in ALL_WORKLOADS:
        present = [s for s in systems if workload in data["results"][s]]
        if not present:
            continue
        lines += ["", f"## {workload} — {WORKLOAD_TITLES[workload]}", ""]
        metrics: set[str] = set()
        for s in present:
            metrics |= set(data["results"][s][workload].get("summary", {}))
        lines.append("| metric | " + " | ".join(present) + " |")
        lines.append("| --- |" + " --- |" * len(present))
        status_row = []
        for s in present:
            entry = data["results"][s][workload]
            runs = entry.get("runs", [])
            errors = sum(1 for r in runs if "error" in r)
            status_row.append(
                entry["status"]
                if entry["status"] != "ok"
                else f"{len(runs) - errors} run(s)" + (f", {errors} failed" if errors else "")
            )
        lines.append("| status | " + " | ".join(status_row) + " |")
        for m in order_metrics(metrics):
            cells = []
            for s in present:
                entry = data["results"][s][workload]
                cells.append("n/a" if entry["status"] == "n/a" else fmt_summary(entry.get("summary", {}).get(m)))
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
        notes = []
        for s in present:
            entry = data["results"][s][workload]
            if entry.get("note"):
                notes.append(f"- {s}: {entry['note']}")
            for r in entry.get("runs", []):
                if "error" in r:
                    first = r["error"].strip().splitlines()[-1] if r["error"].strip() else "error"
                    notes.append(f"- {s}: run failed: `{first[:200]}`")
                    break
        if notes:
            lines += [""] + notes
    if data.get("ratios"):
        lines += ["", "## Orbit / peer (ratio of medians; > 1 means Orbit is faster)", ""]
        peers = sorted({p for row in data["ratios"].values() for p in row}, key=list(REGISTRY).index)
        lines.append("| metric | " + " | ".join(peers) + " |")
        lines.append("| --- |" + " --- |" * len(peers))
        for metric, row in data["ratios"].items():
            lines.append(f"| {metric} | " + " | ".join(fmt_number(row[p]) if p in row else "–" for p in peers) + " |")
    lines += ["", "## Versions", "", ", ".join(f"{k} {v}" for k, v in data.get("versions", {}).items() if v)]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default=",".join(REGISTRY), help="comma-separated: " + ",".join(REGISTRY))
    parser.add_argument("--workloads", default=",".join(ALL_WORKLOADS))
    parser.add_argument("--runs", type=int, default=None, help="runs per system and workload (5; --quick: 1)")
    parser.add_argument("--quick", action="store_true", help="small sizes (1,000 tasks, W5 1,000 vs 20,000)")
    parser.add_argument("--fresh", action="store_true", help="do not merge into existing results")
    parser.add_argument("--skip-setup", action="store_true", help="use bench/.venv as it is")
    parser.add_argument("--one", nargs=2, metavar=("SYSTEM", "WORKLOAD"), help=argparse.SUPPRESS)
    parser.add_argument("--scale", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--describe", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.one:
        child_one(args.one[0], args.one[1], json.loads(args.scale), Path(args.out))
        return
    if args.describe:
        child_describe(args.describe.split(","))
        return

    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    workloads = [w.strip().upper() for w in args.workloads.split(",") if w.strip()]
    unknown = [s for s in systems if s not in REGISTRY] + [w for w in workloads if w not in ALL_WORKLOADS]
    if unknown:
        parser.error(f"unknown: {', '.join(unknown)}")
    systems = [s for s in REGISTRY if s in systems]  # fixed order
    workloads = [w for w in ALL_WORKLOADS if w in workloads]
    base = QUICK if args.quick else FULL
    runs = args.runs if args.runs is not None else (1 if args.quick else 5)

    ensure_venv(args.skip_setup)
    common.RESULTS_DIR.mkdir(exist_ok=True)
    clean_scratch()
    info = describe(systems)

    data = {"mode": base["mode"], "results": {}, "systems": {}}
    if RESULTS_JSON.exists() and not args.fresh:
        try:
            previous = json.loads(RESULTS_JSON.read_text())
            if previous.get("mode") == base["mode"]:
                data = previous
            else:
                log(f"existing results are mode={previous.get('mode')}: starting over")
        except (OSError, ValueError):
            pass
    data.update(
        generated_at=datetime.now(UTC).isoformat(timespec="seconds"),
        mode=base["mode"],
        scale={k: v for k, v in base.items()},
        runs_requested=runs,
        machine=machine_info(),
        services=info["services"],
        versions=info["versions"],
    )
    data.setdefault("results", {})
    data.setdefault("systems", {})
    data["systems"].update(info["systems"])

    def save() -> None:
        data["ratios"] = ratios(data["results"])
        RESULTS_JSON.write_text(json.dumps(data, indent=2, default=str) + "\n")
        RESULTS_MD.write_text(render_markdown(data))

    # Runs are interleaved (run 1 of every system and workload, then run 2, ...),
    # one at a time, so a drift in the machine's speed spreads over all systems.
    entries: dict[tuple[str, str], dict] = {}
    for system in systems:
        meta = info["systems"].get(system, {})
        per = data["results"].setdefault(system, {})
        down = [s for s in REQUIRES.get(system, ()) if not common.tcp_up(common.SERVICE_PORTS[s])]
        for workload in workloads:
            if "error" in meta:
                per[workload] = {"status": "error", "runs": [], "note": meta["error"].strip().splitlines()[-1]}
            elif workload not in meta["workloads"]:
                per[workload] = {"status": "n/a", "runs": [], "note": meta["notes"].get(workload, "n/a")}
            elif down:
                per[workload] = {"status": "skipped", "runs": [], "note": f"service down: {', '.join(down)}"}
            else:
                entries[system, workload] = {"status": "ok", "runs": [], "note": meta["notes"].get(workload, "")}
    for r in range(runs):
        for (system, workload), entry in entries.items():
            scale = {**base, "run": r, "deadline_s": DEADLINES[base["mode"]][workload]}
            log(f"{system} {workload} run {r + 1}/{runs} ...")
            result = run_one(system, workload, scale)
            entry["runs"].append(result)
            brief = (
                result.get("error", "").strip().splitlines()[-1:]
                if "error" in result
                else [", ".join(f"{k}={v}" for k, v in list(result.items())[:6])]
            )
            flag = "ERROR " if "error" in result else ""
            took = result.get("_elapsed_s")
            log(f"{system} {workload} run {r + 1}: {flag}{brief[0] if brief else ''} ({took} s)")
            entry["summary"] = summarize_runs(entry["runs"])
            if all("error" in run for run in entry["runs"]):
                entry["status"] = "error"
            data["results"][system][workload] = entry
            save()
    save()
    log(f"wrote {RESULTS_JSON} and {RESULTS_MD}")


if __name__ == "__main__":
    main()
