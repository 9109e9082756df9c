"""Shared helpers for the benchmark harness and the system modules.

Everything here is standard library only; database drivers are imported lazily inside the
helpers that need them, so ``run_all.py`` itself can run on any Python 3.11.

Contents:
- paths (``BENCH_DIR``, ``ROOT``, ``RESULTS_DIR``, ``VENV_PYTHON``, ``ORBIT_PYTHON``);
- statistics (``percentile``, ``latency_metrics``, ``summarize``);
- CPU accounting from ``/proc/<pid>/stat`` (``CpuMeter``) for the processes a run starts
  ("server") and for the shared services ("db": mariadbd, postgres, redis-server,
  beam.smp), plus the harness process itself ("client");
- process control (``spawn``, ``stop_process``, ``kill9``, ``reap_registered``): every
  process a run starts gets its own session and is recorded in ``$BENCH_PIDFILE`` so that
  ``run_all.py`` can end exactly those processes (by pid, checked against start time) if a
  run overruns or crashes;
- the task event log (``log_event`` in workers, ``EventLog`` in the harness): one
  append-only file per worker process, one line per task start/finish with the wall clock;
- workload analysis (``rate_metrics`` for W3, ``overlap_check`` for W2, ``crash_metrics``
  for W4);
- fresh databases on the shared MariaDB / PostgreSQL (``fresh_mariadb``,
  ``fresh_postgres``) and the services' durability settings (``service_settings``).
"""

from __future__ import annotations

import math
import os
import resource
import signal
import socket
import statistics
import subprocess
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"
VENV_DIR = BENCH_DIR / ".venv"
VENV_PYTHON = VENV_DIR / "bin" / "python"
ORBIT_PYTHON = ROOT / ".venv" / "bin" / "python"
WORK_DIR = BENCH_DIR / ".work"  # scratch: event logs, worker logs (ignored by git)

MARIADB = {"host": "127.0.0.1", "port": 3306, "user": "root", "passwd": ""}
POSTGRES_DSN = "host=127.0.0.1 port=5432 user=postgres dbname=postgres"
REDIS_HOST, REDIS_PORT = "127.0.0.1", 6379
RABBITMQ_HOST, RABBITMQ_PORT = "127.0.0.1", 5672

# comm names (as in /proc/<pid>/comm, max 15 chars) of the shared services' processes
SERVICES: dict[str, tuple[str, ...]] = {
    "mariadb": ("mariadbd", "mysqld"),
    "postgres": ("postgres",),
    "redis": ("redis-server",),
    "rabbitmq": ("beam.smp",),
}
SERVICE_PORTS = {"mariadb": 3306, "postgres": 5432, "redis": 6379, "rabbitmq": 5672}

now = time.time  # wall clock: comparable across the harness and worker processes


# ---------------------------------------------------------------------------- statistics


def percentile(values: Iterable[float], q: float) -> float:
    """q in [0, 100], linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    if len(ordered) == 1:
        return ordered[0]
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def latency_metrics(seconds: Iterable[float], prefix: str = "latency") -> dict[str, float]:
    """p50/p95/p99 in milliseconds, keys ``{prefix}_p50_ms`` …"""
    values = list(seconds)
    if not values:
        return {f"{prefix}_p50_ms": None, f"{prefix}_p95_ms": None, f"{prefix}_p99_ms": None}
    return {
        f"{prefix}_p50_ms": round(percentile(values, 50) * 1000, 2),
        f"{prefix}_p95_ms": round(percentile(values, 95) * 1000, 2),
        f"{prefix}_p99_ms": round(percentile(values, 99) * 1000, 2),
    }


def summarize(values: list) -> dict:
    """Median and spread of one metric over runs. Numbers → median/min/max; booleans →
    all/any; anything else → the distinct values."""
    present = [v for v in values if v is not None]
    if not present:
        return {"n": 0}
    if all(isinstance(v, bool) for v in present):
        return {"n": len(present), "all": all(present), "any": any(present)}
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in present):
        numbers = [float(v) for v in present if not math.isnan(float(v))]
        if not numbers:
            return {"n": 0}
        return {
            "n": len(numbers),
            "median": statistics.median(numbers),
            "min": min(numbers),
            "max": max(numbers),
        }
    distinct = []
    for v in present:
        if v not in distinct:
            distinct.append(v)
    return {"n": len(present), "values": distinct}


# ---------------------------------------------------------------------------- CPU


CLK_TCK = os.sysconf("SC_CLK_TCK")


def _read_stat(pid: int) -> tuple[str, int, int, int, int, int] | None:
    """(comm, ppid, pgid, sid, cpu_ticks incl. reaped children, starttime) or None."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes().decode(errors="replace")
    except OSError:
        return None
    lpar, rpar = raw.find("("), raw.rfind(")")
    comm = raw[lpar + 1 : rpar]
    fields = raw[rpar + 2 :].split()
    # fields[0] is field 3 (state); utime=14, stime=15, cutime=16, cstime=17, starttime=22
    ppid, pgid, sid = int(fields[1]), int(fields[2]), int(fields[3])
    ticks = int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])
    return comm, ppid, pgid, sid, ticks, int(fields[19])


def process_table() -> dict[int, tuple[str, int, int, int, int, int]]:
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _read_stat(int(entry))
            if stat is not None:
                table[int(entry)] = stat
    return table


def process_tree(roots: Iterable[int], table: dict | None = None) -> set[int]:
    """The given pids and all their live descendants."""
    table = process_table() if table is None else table
    children: dict[int, list[int]] = defaultdict(list)
    for pid, stat in table.items():
        children[stat[1]].append(pid)
    found: set[int] = set()
    stack = [pid for pid in roots if pid in table]
    while stack:
        pid = stack.pop()
        if pid in found:
            continue
        found.add(pid)
        stack.extend(children.get(pid, ()))
    return found


def service_pids(services: Iterable[str], table: dict | None = None) -> set[int]:
    table = process_table() if table is None else table
    names = {name for service in services for name in SERVICES[service]}
    return {pid for pid, stat in table.items() if stat[0] in names}


def machine_jiffies() -> tuple[int, int]:
    """(busy, busy + idle) clock ticks of every core since boot, from /proc/stat's
    first line: busy is user, nice, system, irq and softirq; idle is idle and iowait.
    Steal (the hypervisor's) and guest (inside user already) are left out."""
    with open("/proc/stat") as stat:
        user, nice, system, idle, iowait, irq, softirq = (int(f) for f in stat.readline().split()[1:8])
    busy = user + nice + system + irq + softirq
    return busy, busy + idle + iowait


class CpuMeter:
    """CPU seconds spent between ``start()`` and ``stop()``.

    - server: the process trees rooted at ``server_pids()`` (what the run started: Orbit's
      daphne; a peer's worker processes);
    - db: every process of the named shared services (``SERVICES`` keys);
    - client: this harness process (all its threads);
    - machine: every process on the machine (/proc/stat's busy time, all cores): what the
      run cost in all, workers and everything else included, and the share of the machine
      it kept busy. Its per-task figure bounds the rate: no run can go faster than
      ``cpus / machine CPU seconds per task`` (``cpu_bound_tasks_per_s``).

    Each snapshot sums utime+stime+cutime+cstime over the set, so a child that exits
    between snapshots is still counted through its parent's cutime when the parent is in
    the set (postgres backends, prefork children). A process killed between snapshots
    whose parent is outside the set is lost (only W4 kills, and W4 reports no CPU).
    The services are shared: anything else using them at the same time is counted too.
    """

    def __init__(self, server_pids: Callable[[], Iterable[int]] | Iterable[int] = (), services: Iterable[str] = ()):
        self._server = server_pids if callable(server_pids) else (lambda pids=tuple(server_pids): pids)
        self._services = tuple(services)
        self._t0: tuple[float, ...] | None = None
        self.result: dict[str, float] = {}

    def _snapshot(self) -> tuple[float, ...]:
        table = process_table()
        server = process_tree(self._server(), table)
        db = service_pids(self._services, table)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        busy, elapsed = machine_jiffies()
        return (
            sum(table[p][4] for p in server) / CLK_TCK,
            sum(table[p][4] for p in db) / CLK_TCK,
            usage.ru_utime + usage.ru_stime,
            time.monotonic(),
            busy / CLK_TCK,
            elapsed / CLK_TCK,
        )

    def start(self) -> CpuMeter:
        self._t0 = self._snapshot()
        return self

    def stop(self) -> dict[str, float]:
        assert self._t0 is not None, "CpuMeter.stop() before start()"
        t1 = self._snapshot()
        self.result = {
            "server_cpu_s": round(max(0.0, t1[0] - self._t0[0]), 3),
            "db_cpu_s": round(max(0.0, t1[1] - self._t0[1]), 3),
            "client_cpu_s": round(max(0.0, t1[2] - self._t0[2]), 3),
            "wall_s": round(t1[3] - self._t0[3], 3),
            "machine_cpu_s": round(max(0.0, t1[4] - self._t0[4]), 3),
            "machine_busy_pct": round(100 * (t1[4] - self._t0[4]) / max(1e-9, t1[5] - self._t0[5]), 1),
        }
        return self.result

    def per_1k(self, tasks: int) -> dict[str, float]:
        """``server_cpu_s_per_1k``, ``db_cpu_s_per_1k``, ``client_cpu_s_per_1k``,
        ``machine_cpu_s_per_1k``, ``machine_busy_pct`` and ``cpu_bound_tasks_per_s``."""
        r = self.result or self.stop()
        scale = 1000.0 / max(1, tasks)
        machine_per_task = r["machine_cpu_s"] / max(1, tasks)
        return {
            "server_cpu_s_per_1k": round(r["server_cpu_s"] * scale, 3),
            "db_cpu_s_per_1k": round(r["db_cpu_s"] * scale, 3),
            "client_cpu_s_per_1k": round(r["client_cpu_s"] * scale, 3),
            "machine_cpu_s_per_1k": round(r["machine_cpu_s"] * scale, 3),
            "machine_busy_pct": r["machine_busy_pct"],
            "cpu_bound_tasks_per_s": round((os.cpu_count() or 1) / machine_per_task, 1) if machine_per_task else None,
        }


# ---------------------------------------------------------------------------- processes

PIDFILE_ENV = "BENCH_PIDFILE"
_spawn_lock = threading.Lock()


def spawn(
    cmd: list[str],
    *,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    log: str | Path | None = None,
) -> subprocess.Popen:
    """Start a process in its own session (so its whole tree can be signalled as one
    group) and record it in ``$BENCH_PIDFILE`` for ``run_all.py``'s safety net."""
    out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115
    try:
        proc = subprocess.Popen(
            cmd,
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    finally:
        if log:
            out.close()
    pidfile = os.environ.get(PIDFILE_ENV)
    stat = _read_stat(proc.pid)
    proc.bench_started = stat[5] if stat is not None else 0  # type: ignore[attr-defined]
    if pidfile and stat is not None:
        with _spawn_lock, open(pidfile, "a") as fh:
            fh.write(f"{proc.pid} {stat[5]}\n")
    return proc


def _group_members(sid: int, started_after: int) -> list[int]:
    """Live processes of the session ``sid`` (which we created) started no earlier than it."""
    return [
        pid
        for pid, stat in process_table().items()
        if stat[3] == sid and stat[5] >= started_after and pid != os.getpid()
    ]


def _signal_session(proc: subprocess.Popen, sig: int) -> None:
    """Signal every live member of the session we created for ``proc`` (by pid, checked
    against session id and start time, so a recycled pid is never hit)."""
    for member in _group_members(proc.pid, getattr(proc, "bench_started", 0)):
        try:
            os.kill(member, sig)
        except ProcessLookupError:
            pass


def session_pids(proc: subprocess.Popen) -> list[int]:
    return _group_members(proc.pid, getattr(proc, "bench_started", 0))


def stop_process(proc: subprocess.Popen, timeout: float = 20.0) -> None:
    """Graceful stop: SIGTERM to the process (it stops its own children), then SIGKILL to
    the whole session after ``timeout``; stragglers of the session are ended too."""
    if proc.poll() is None:
        try:
            proc.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _signal_session(proc, signal.SIGKILL)
            proc.wait(timeout=10)
    # children that outlived their leader (e.g. pool processes): end them too
    if wait_until(lambda: not session_pids(proc), 5.0, 0.1) is False:
        _signal_session(proc, signal.SIGKILL)


def kill9(proc: subprocess.Popen) -> None:
    """Crash: SIGKILL the process and everything in its session at once, no clean-up."""
    _signal_session(proc, signal.SIGKILL)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def reap_registered(pidfile: str | Path) -> list[int]:
    """End what a run recorded in its pidfile and left behind: every live process of
    those sessions whose start time is not before the recorded leader's. Returns the pids
    signalled. Used by run_all.py after each run (and on timeout)."""
    path = Path(pidfile)
    if not path.exists():
        return []
    killed = []
    for line in path.read_text().splitlines():
        try:
            pid, started = (int(x) for x in line.split())
        except ValueError:
            continue
        for member in _group_members(pid, started):
            try:
                os.kill(member, signal.SIGKILL)
                killed.append(member)
            except ProcessLookupError:
                pass
    return killed


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def tcp_up(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def work_dir(name: str) -> Path:
    """A fresh scratch directory under bench/.work/."""
    path = WORK_DIR / f"{name}-{os.getpid()}-{int(time.time() * 1000)}"
    path.mkdir(parents=True, exist_ok=True)
    return path


# ---------------------------------------------------------------------------- task events

EVENT_DIR_ENV = "BENCH_EVENT_DIR"
ROLE_ENV = "BENCH_ROLE"
_event_fd: tuple[int, int] | None = None  # (pid, fd)
_event_lock = threading.Lock()


def log_event(kind: str, key: object) -> None:
    """Called inside worker processes: append ``kind key wall_time pid role``.

    kind: ``S`` task body started, ``D`` task body finished, ``R`` worker ready.
    One file per process, O_APPEND, one ``write`` per line."""
    global _event_fd
    directory = os.environ.get(EVENT_DIR_ENV)
    if not directory:
        return
    pid = os.getpid()
    with _event_lock:
        if _event_fd is None or _event_fd[0] != pid:  # first call, or after a fork
            fd = os.open(f"{directory}/{pid}.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            _event_fd = (pid, fd)
        line = f"{kind} {key} {time.time():.6f} {pid} {os.environ.get(ROLE_ENV, 'w')}\n"
        os.write(_event_fd[1], line.encode())


class EventLog:
    """Harness side: incremental reader of every worker's event file in ``directory``."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self._offsets: dict[Path, int] = {}
        self._partial: dict[Path, bytes] = {}
        self.starts: dict[str, list[tuple[float, int, str]]] = defaultdict(list)
        self.dones: dict[str, list[tuple[float, int, str]]] = defaultdict(list)
        self.ready: dict[int, tuple[str, float]] = {}  # pid -> (role, time)
        self._done_n: dict[str, int] = defaultdict(int)  # prefix -> distinct keys done
        self._start_n: dict[str, int] = defaultdict(int)  # prefix -> distinct keys started
        self._last_done: dict[str, float] = defaultdict(float)

    def env(self, role: str = "w") -> dict[str, str]:
        return {EVENT_DIR_ENV: str(self.directory), ROLE_ENV: role}

    def poll(self) -> EventLog:
        for path in self.directory.glob("*.log"):
            offset = self._offsets.get(path, 0)
            try:
                with open(path, "rb") as fh:
                    fh.seek(offset)
                    data = fh.read()
            except OSError:
                continue
            if not data:
                continue
            self._offsets[path] = offset + len(data)
            data = self._partial.pop(path, b"") + data
            lines = data.split(b"\n")
            if lines[-1]:
                self._partial[path] = lines[-1]
            for line in lines[:-1]:
                parts = line.decode().split()
                if len(parts) != 5:
                    continue
                kind, key, at, pid, role = parts
                record = (float(at), int(pid), role)
                prefix = key.rpartition("-")[0]
                if kind == "S":
                    if key not in self.starts:
                        self._start_n[prefix] += 1
                    self.starts[key].append(record)
                elif kind == "D":
                    if key not in self.dones:
                        self._done_n[prefix] += 1
                    self.dones[key].append(record)
                    self._last_done[prefix] = max(self._last_done[prefix], record[0])
                elif kind == "R":
                    self.ready[int(pid)] = (role, float(at))
        return self

    def done_count(self, keys: Iterable[str]) -> int:
        return sum(1 for k in keys if k in self.dones)

    def started_count(self, keys: Iterable[str]) -> int:
        return sum(1 for k in keys if k in self.starts)

    # task keys "<prefix>-<n>": O(1) counts of distinct keys per prefix

    def done_by_prefix(self, prefix: str) -> int:
        return self._done_n.get(prefix, 0)

    def started_by_prefix(self, prefix: str) -> int:
        return self._start_n.get(prefix, 0)

    def last_done(self, prefix: str) -> float:
        return self._last_done.get(prefix, 0.0)


# ---------------------------------------------------------------------------- analysis


def rate_metrics(start_times: Iterable[float], rate: float, seconds: float, t0: float) -> dict:
    """W3: starts within [t0, t0 + seconds). achieved_rate = starts / seconds;
    worst_window = the most starts in any sliding 1-second interval (the limit is broken
    when it exceeds ``rate``); min_window = the fewest starts in a whole fixed 1-second
    window (under-delivery while demand exceeded the limit)."""
    ts = sorted(t for t in start_times if t0 <= t < t0 + seconds)
    worst = 0
    j = 0
    for i, t in enumerate(ts):
        while ts[j] <= t - 1.0:
            j += 1
        worst = max(worst, i - j + 1)
    buckets = [0] * int(seconds)
    for t in ts:
        index = int(t - t0)
        if index < len(buckets):
            buckets[index] += 1
    return {
        "target_rate": rate,
        "achieved_rate": round(len(ts) / seconds, 2),
        "worst_window": worst,
        "min_window": min(buckets) if buckets else None,
        "windows_over_limit": sum(1 for b in buckets if b > rate),
        "rate_error_pct": round(100.0 * (len(ts) / seconds - rate) / rate, 1),
        "windows": buckets,  # starts per fixed 1 s window (a list: kept, not aggregated)
    }


def overlap_check(executions: Iterable[tuple[str, float, float]]) -> tuple[bool, int]:
    """W2: executions (key, start, end). Returns (no two executions of a key overlapped,
    number of overlapping pairs found)."""
    by_key: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for key, start, end in executions:
        by_key[key].append((start, end))
    violations = 0
    for spans in by_key.values():
        spans.sort()
        latest_end = -math.inf
        for start, end in spans:
            if start < latest_end:
                violations += 1
            latest_end = max(latest_end, end)
    return violations == 0, violations


def crash_metrics(events: EventLog, keys: list[str], t_kill: float, victim_role: str = "victim") -> dict:
    """W4, from the event log: tasks not finished at the kill were held by the victim
    (running, or reserved/prefetched); measure when each ran again elsewhere."""
    held = [k for k in keys if not any(t < t_kill for t, _, _ in events.dones.get(k, []))]
    held_running = [k for k in held if any(r == victim_role and t < t_kill for t, _, r in events.starts.get(k, []))]
    rerun_delays = []
    lost = 0
    for k in held:
        later = [t for t, _, r in events.starts.get(k, []) if t >= t_kill and r != victim_role]
        if later:
            rerun_delays.append(min(later) - t_kill)
        else:
            lost += 1
    duplicates = sum(1 for k in keys if len(events.dones.get(k, [])) > 1)
    executions = sum(len(events.starts.get(k, [])) for k in keys)
    return {
        "tasks": len(keys),
        "held_total": len(held),
        "held_running": len(held_running),
        "first_rerun_s": round(min(rerun_delays), 3) if rerun_delays else None,
        "relapse_s": round(max(rerun_delays), 3) if rerun_delays and not lost else None,
        "lost": lost,
        "duplicates": duplicates,
        "extra_executions": executions - len(keys),
        "stale_writes_rejected": None,  # needs fencing tokens; n/a unless the system has them
    }


# ---------------------------------------------------------------------------- databases


def mariadb_connect(database: str | None = None):
    import MySQLdb  # noqa: PLC0415

    kwargs = dict(MARIADB)
    if database:
        kwargs["db"] = database
    return MySQLdb.connect(**kwargs)


def fresh_mariadb(name: str) -> str:
    db = mariadb_connect()
    try:
        cur = db.cursor()
        cur.execute(f"DROP DATABASE IF EXISTS `{name}`")
        cur.execute(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4 COLLATE utf8mb4_unicode_ci")
    finally:
        db.close()
    return name


def drop_mariadb(name: str) -> None:
    db = mariadb_connect()
    try:
        db.cursor().execute(f"DROP DATABASE IF EXISTS `{name}`")
    finally:
        db.close()


def _pg_admin():
    import psycopg  # noqa: PLC0415

    return psycopg.connect(POSTGRES_DSN, autocommit=True)


def fresh_postgres(name: str) -> str:
    with _pg_admin() as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    return f"host=127.0.0.1 port=5432 user=postgres dbname={name}"


def drop_postgres(name: str) -> None:
    with _pg_admin() as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def service_settings() -> dict[str, dict]:
    """Durability-relevant settings of the shared services, as found right now."""
    found: dict[str, dict] = {}
    try:
        db = mariadb_connect()
        cur = db.cursor()
        cur.execute(
            "SELECT @@version, @@innodb_flush_log_at_trx_commit, @@sync_binlog, @@log_bin, "
            "@@tx_isolation, @@innodb_buffer_pool_size, @@innodb_doublewrite"
        )
        row = cur.fetchone()
        db.close()
        keys = [
            "version",
            "innodb_flush_log_at_trx_commit",
            "sync_binlog",
            "log_bin",
            "tx_isolation",
            "innodb_buffer_pool_size",
            "innodb_doublewrite",
        ]
        found["mariadb"] = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in zip(keys, row, strict=False)}
    except Exception as exc:  # noqa: BLE001
        found["mariadb"] = {"error": repr(exc)}
    try:
        with _pg_admin() as conn:
            found["postgres"] = {
                k: conn.execute(f"SHOW {k}").fetchone()[0]
                for k in (
                    "server_version",
                    "fsync",
                    "synchronous_commit",
                    "wal_sync_method",
                    "shared_buffers",
                    "max_connections",
                )
            }
    except Exception as exc:  # noqa: BLE001
        found["postgres"] = {"error": repr(exc)}
    try:
        found["redis"] = _redis_config(("appendonly", "appendfsync", "save", "maxmemory-policy"))
    except Exception as exc:  # noqa: BLE001
        found["redis"] = {"error": repr(exc)}
    try:
        out = subprocess.run(["rabbitmqctl", "version"], capture_output=True, text=True, timeout=30)
        found["rabbitmq"] = {"version": out.stdout.strip().splitlines()[-1] if out.stdout.strip() else None}
    except Exception as exc:  # noqa: BLE001
        found["rabbitmq"] = {"error": repr(exc)}
    return found


def _redis_config(keys: Iterable[str]) -> dict[str, str]:
    """CONFIG GET over a raw socket (RESP), so the harness needs no redis client."""
    result = {}
    with socket.create_connection((REDIS_HOST, REDIS_PORT), timeout=2) as sock:
        reader = sock.makefile("rb")
        for key in keys:
            sock.sendall(f"*3\r\n$6\r\nCONFIG\r\n$3\r\nGET\r\n${len(key)}\r\n{key}\r\n".encode())
            header = reader.readline()
            count = int(header[1:])
            items = []
            for _ in range(count):
                length = int(reader.readline()[1:])
                items.append(reader.read(length + 2)[:-2].decode())
            result.update(dict(zip(items[::2], items[1::2], strict=False)))
    return result
