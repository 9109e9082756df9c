"""A private, throw-away MariaDB server for the chaos harness.

Never touches the shared server on 127.0.0.1:3306: it has its own datadir,
socket and port, and it is the only server the harness ever kills.

    db = PrivateMariaDB(base_dir)      # base_dir: a fresh directory we own
    db.start()                         # initialises the datadir on first start
    db.stop(kill=True)                 # kill -9 (crash) or SIGTERM (clean shutdown)
    db.start()                         # same port, same datadir: crash recovery
    db.dsn("orbit_chaos")              # mysql://root:@127.0.0.1:<port>/orbit_chaos
    db.cleanup()                       # stop and remove the directory
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import MySQLdb

INSTALL_DB = shutil.which("mariadb-install-db") or shutil.which("mysql_install_db")
SERVER = shutil.which("mariadbd") or shutil.which("mysqld") or "/usr/sbin/mariadbd"


def available() -> str | None:
    """None when a private server can be started here, else the reason it cannot."""
    if INSTALL_DB is None:
        return "mariadb-install-db not found"
    if not os.path.exists(SERVER):
        return "mariadbd not found"
    return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PrivateMariaDB:
    def __init__(self, base_dir: Path, port: int | None = None, extra_args: tuple[str, ...] = ()) -> None:
        self.base_dir = Path(base_dir)
        self.extra_args = extra_args  # more mariadbd options, e.g. a benchmark's performance_schema
        self.datadir = self.base_dir / "data"
        self.socket = self.base_dir / "mysqld.sock"
        self.pid_file = self.base_dir / "mysqld.pid"
        self.log_path = self.base_dir / "mariadb.log"
        self.port = port or free_port()
        self.process: subprocess.Popen | None = None
        self.as_root = os.geteuid() == 0
        self.starts = 0

    # -- lifecycle -------------------------------------------------------------

    def _user_args(self) -> list[str]:
        return ["--user=mysql"] if self.as_root else []

    def _chown(self, path: Path) -> None:
        if self.as_root:
            shutil.chown(path, "mysql", "mysql")

    def initialise(self) -> None:
        self.base_dir.mkdir(parents=True, exist_ok=True)
        self._chown(self.base_dir)
        assert INSTALL_DB is not None
        result = subprocess.run(
            [
                INSTALL_DB,
                "--no-defaults",
                *self._user_args(),
                f"--datadir={self.datadir}",
                "--auth-root-authentication-method=normal",
                "--skip-test-db",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if result.returncode != 0:
            raise RuntimeError(f"mariadb-install-db failed:\n{result.stdout}\n{result.stderr}")

    def start(self, timeout: float = 60.0) -> float:
        """Starts the server (initialising the datadir once); returns seconds until it answered."""
        if self.process is not None and self.process.poll() is None:
            raise RuntimeError("private MariaDB is already running")
        if not self.datadir.exists():
            self.initialise()
        began = time.monotonic()
        log = open(self.log_path, "a")  # noqa: SIM115 - handed to the child
        self.process = subprocess.Popen(
            [
                SERVER,
                "--no-defaults",
                *self._user_args(),
                f"--datadir={self.datadir}",
                f"--socket={self.socket}",
                f"--pid-file={self.pid_file}",
                f"--port={self.port}",
                "--bind-address=127.0.0.1",
                "--skip-name-resolve",
                "--innodb-buffer-pool-size=256M",
                "--innodb-log-file-size=64M",
                "--max-connections=500",
                "--character-set-server=utf8mb4",
                "--collation-server=utf8mb4_unicode_ci",
                f"--log-error={self.log_path}",
                *self.extra_args,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        self.starts += 1
        deadline = began + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"private MariaDB exited with {self.process.returncode}; see {self.log_path}")
            if self.ping():
                return time.monotonic() - began
            time.sleep(0.1)
        raise RuntimeError(f"private MariaDB did not answer within {timeout:.0f} s; see {self.log_path}")

    def stop(self, kill: bool = False, timeout: float = 60.0) -> None:
        """kill=True: SIGKILL (a crash, InnoDB recovers on the next start); else SIGTERM and wait."""
        process = self.process
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        # The port must be free before the next start binds it again.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and self._port_open():
            time.sleep(0.05)

    def freeze(self) -> None:
        """SIGSTOP: the port still accepts TCP connections but nothing answers (a hung host)."""
        if self.running:
            self.process.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        if self.running:
            self.process.send_signal(signal.SIGCONT)

    def restart(self, kill: bool = False, down_seconds: float = 0.0) -> float:
        self.stop(kill=kill)
        if down_seconds:
            time.sleep(down_seconds)
        return self.start()

    def cleanup(self) -> None:
        try:
            self.thaw()
            self.stop(kill=True)
        finally:
            shutil.rmtree(self.base_dir, ignore_errors=True)

    # -- access ----------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def _port_open(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                return True
        except OSError:
            return False

    def connect(self, database: str | None = None, timeout: int = 5) -> MySQLdb.Connection:
        kwargs = {"db": database} if database else {}
        return MySQLdb.connect(
            host="127.0.0.1",
            port=self.port,
            user="root",
            passwd="",
            connect_timeout=timeout,
            charset="utf8mb4",
            **kwargs,
        )

    def ping(self) -> bool:
        try:
            conn = self.connect(timeout=1)
        except MySQLdb.Error:
            return False
        conn.close()
        return True

    def create_database(self, name: str) -> None:
        conn = self.connect()
        try:
            cursor = conn.cursor()
            cursor.execute(f"DROP DATABASE IF EXISTS `{name}`")
            cursor.execute(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4 COLLATE utf8mb4_unicode_ci")
        finally:
            conn.close()

    def dsn(self, database: str) -> str:
        return f"mysql://root:@127.0.0.1:{self.port}/{database}"
