"""The worker's WebSocket to the server, kept across reconnects (docs/protocol.md).

:class:`Link` connects, says hello, reconnects with backoff when the connection drops, and
carries requests and their replies. What a close code or a refused handshake means is decided
here: some are final (a bad token), the others are reconnected after. What the frames mean for
the attempts is the owner's business (the Worker), told through :class:`LinkEvents`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHeader, InvalidStatus, InvalidURI, WebSocketException

from orbit_sdk._exceptions import APIError, ProtocolError
from orbit_sdk._protocol import TRANSIENT_CODES, decoded, encoded, error_code, fatal, seconds

logger = logging.getLogger("orbit_sdk.worker")

OPEN_TIMEOUT = 10.0  # seconds for the WebSocket opening handshake
CLOSE_TIMEOUT = 2.0  # seconds to wait for the closing handshake
DEFAULT_LEASE_SECONDS = 30.0  # until hello.ok says otherwise
DEFAULT_RENEW_SECONDS = 10.0  # until hello.ok says otherwise

# Close codes after which reconnecting with the same hello cannot help.
FATAL_CLOSE_CODES = {4401: "UNAUTHENTICATED", 4403: "PERMISSION_DENIED", 4409: "STATE_CONFLICT"}
FATAL_HTTP_STATUSES = {401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND"}


def retried_status(status: int) -> bool:
    """A handshake answer that may differ next time: a server (or proxy) starting, overloaded,
    timing out or moving the application's cell. Any other (a page, 400, 426) is what the
    URL's server answers every time."""
    return status in (408, 429) or 500 <= status <= 599


# Close codes after which the worker reconnects, logging the server's error frame sent before.
CLOSE_MEANINGS = {
    1009: "a frame over the server's message size limit",
    4408: "assignments not acknowledged in time",
    4503: "the application moved to another cell",
}


class _Redacting(logging.LoggerAdapter[logging.Logger]):
    """websockets' connection logger (``websockets.client``, as configured) without the bearer
    token: at DEBUG it writes the handshake's request headers, Authorization included."""

    def __init__(self, redact: Callable[[str], str]) -> None:
        super().__init__(logging.getLogger("websockets.client"), {})
        self._redact = redact

    def log(self, level: int, msg: object, *args: object, **kwargs: Any) -> None:
        if self.isEnabledFor(level):
            text = str(msg)
            if len(args) == 1 and isinstance(args[0], Mapping) and args[0]:
                text %= args[0]  # as a LogRecord reads one mapping: "%(name)s"
            elif args:
                text %= args
            self.logger.log(level, "%s", self._redact(text), **kwargs)


class NoAnswer(Exception):
    """A request got no reply: the connection closed, or the reply did not come in time."""


def _no_reply(future: asyncio.Future[dict[str, Any]], kind: str, timeout: float) -> None:
    if not future.done():
        future.set_exception(NoAnswer(f"no reply to {kind} within {timeout}s"))


class Abandoned(Exception):
    """The caller no longer wants the request sent."""


class HelloRefused(Exception):
    """The hello was answered "not now" (UNAVAILABLE, INTERNAL): reconnect and try again."""


class Connection:
    """One WebSocket session: its pending requests and what it said before it closed."""

    def __init__(self, ws: ClientConnection, generation: int) -> None:
        self.ws = ws
        self.generation = generation
        self.pending: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self.ready = False  # hello done and held attempts resumed
        self.closed = False
        self.drain_acked = False
        self.last_error: dict[str, Any] | None = None
        self.error_was_last = False  # the last frame received was that error (it says why a close came)
        self.fatal: APIError | None = None


@dataclasses.dataclass(frozen=True)
class LinkEvents:
    """What the link tells the worker that owns it, on the event loop."""

    on_hello: Callable[[Connection, list[Any]], Awaitable[None]]  # hello.ok read: reconcile its `held`
    on_ready: Callable[[Connection], None]  # the connection takes requests
    on_assign: Callable[[Connection, dict[str, Any]], None]  # a task.assign frame
    check_finished: Callable[[], None]  # the worker may be done (drained): sets `done` if so
    spawn: Callable[[Awaitable[Any]], asyncio.Task[Any]]  # a task the worker cancels when it ends


class Link:
    """The connection to the server across reconnects, until `done` is set."""

    def __init__(
        self,
        events: LinkEvents,
        *,
        url: str,
        token: str,
        worker_id: str,
        hello: dict[str, Any],
        done: asyncio.Event,
        request_timeout: float,
        min_reconnect_delay: float,
        max_reconnect_delay: float,
    ) -> None:
        self._events = events
        self._worker_id = worker_id
        self._url = url
        self._token = token
        self._hello = hello
        self._done = done
        self._request_timeout = request_timeout
        self._min_reconnect_delay = min_reconnect_delay
        self._max_reconnect_delay = max_reconnect_delay
        self._reconnect_delay = min_reconnect_delay
        self._websockets_logger = _Redacting(self.redact)
        self._ids = itertools.count(1)
        self._generation = 0
        self.conn: Connection | None = None
        self._closed_conn: Connection | None = None  # the latest connection, kept to say why it closed
        self.ready = asyncio.Event()
        self.session_id: str | None = None
        self.lease_seconds = DEFAULT_LEASE_SECONDS
        self.renew_seconds = DEFAULT_RENEW_SECONDS

    async def run(self) -> None:
        """Connect, and reconnect with backoff, until `done`; raises when refused for good."""
        while True:
            self._events.check_finished()
            if self._done.is_set():
                return
            unusable: Exception | None = None
            try:
                if not await self._connect_until_done():
                    return
            except HelloRefused as exc:
                logger.warning(
                    "orbit worker %s: %s; reconnecting in %.1f s",
                    self._worker_id,
                    self.redact(str(exc)),
                    self._reconnect_delay,
                )
            except InvalidStatus as exc:
                status = exc.response.status_code
                if status in FATAL_HTTP_STATUSES:
                    raise APIError(FATAL_HTTP_STATUSES[status], status, f"handshake refused: HTTP {status}") from exc
                if not retried_status(status):
                    unusable = ProtocolError(
                        f"orbit worker {self._worker_id}: the server answered the WebSocket handshake with "
                        f"HTTP {status}: the server, or a proxy in front of it, does not accept WebSocket "
                        "connections at this URL; not retried"
                    )
                else:
                    logger.warning("orbit worker %s: handshake refused (HTTP %s); retrying", self._worker_id, status)
            except (InvalidHeader, InvalidURI) as exc:
                # Not a lost connection: the same handshake fails the same way every time. Raised
                # below, outside this block, so that websockets' exception (whose text may quote
                # the Authorization header) is not chained to it.
                unusable = self._unusable_handshake(exc)
            except (OSError, TimeoutError, WebSocketException, NoAnswer) as exc:
                logger.warning(
                    "orbit worker %s: connection lost (%s); reconnecting",
                    self._worker_id,
                    self.redact(str(exc) or type(exc).__name__),
                )
            if unusable is not None:
                raise unusable
            self._events.check_finished()
            if self._done.is_set():
                return
            # Reset only by a hello.ok: a server that accepts connections but refuses
            # hellos (UNAVAILABLE) is asked less and less often.
            delay = self._reconnect_delay
            self._reconnect_delay = min(delay * 2, self._max_reconnect_delay)
            try:
                await asyncio.wait_for(self._done.wait(), timeout=delay)
            except TimeoutError:
                pass

    async def _connect_until_done(self) -> bool:
        """One connection, from its handshake to its end; False when `done` came before it
        was ready. A stop does not wait for a handshake or a hello that a frozen or cut-off
        server may never answer (up to OPEN_TIMEOUT and request_timeout): it cancels them.
        A ready session watches `done` itself, and closes within CLOSE_TIMEOUT."""
        serving = asyncio.create_task(self._connect_and_serve())
        stopping = asyncio.create_task(self._done.wait())
        try:
            await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if not serving.done() and not self.ready.is_set():
                serving.cancel()
            await asyncio.wait({serving})
        except asyncio.CancelledError:
            serving.cancel()
            raise
        finally:
            stopping.cancel()
        if serving.cancelled():
            return False
        serving.result()  # what ended the connection, raised for run() to judge
        return True

    async def _connect_and_serve(self) -> None:
        async with connect(
            self._url,
            additional_headers={"Authorization": f"Bearer {self._token}"},
            open_timeout=OPEN_TIMEOUT,
            close_timeout=CLOSE_TIMEOUT,
            max_size=None,
            logger=self._websockets_logger,
        ) as ws:
            await self._session(ws)
        if not self._done.is_set():
            self._log_close(ws)

    def redact(self, text: str) -> str:
        """`text` without the bearer token (nor its secret part): for anything logged or raised
        that quotes what a library said about the connection."""
        # orb_<id>_<secret>, and the secret may hold "_" itself (URL-safe base64).
        parts = self._token.split("_", 2)
        secret = parts[2] if len(parts) == 3 else self._token
        text = text.replace(self._token, "[token]")
        return text.replace(secret, "[secret]") if len(secret) >= 8 else text

    def _unusable_handshake(self, exc: InvalidHeader | InvalidURI) -> Exception:
        """What ends the run when the handshake cannot succeed however often it is tried."""
        if isinstance(exc, InvalidHeader) and exc.name.lower() == "authorization":
            # The value is never quoted: it is the bearer token.
            return ValueError("token: the Authorization header cannot carry it; the worker cannot connect")
        if isinstance(exc, InvalidURI):
            what = f"the WebSocket URL (a redirect's, if the server sent one) is not usable: {exc.msg}"
        else:
            what = (
                f"the server's answer to the WebSocket handshake has {self.redact(str(exc))}: the server, or a "
                "proxy in front of it, does not accept WebSocket connections at this URL"
            )
        return ProtocolError(f"orbit worker {self._worker_id}: {what}; not retried")

    def _log_close(self, ws: ClientConnection) -> None:
        """Why the server closed, in its own words when it sent them (an error frame first)."""
        code = ws.close_code
        conn = self._closed_conn
        error = conn.last_error if conn is not None and conn.error_was_last else None
        said = ""
        if error is not None:
            said = f": {error.get('code')} {error.get('message')}"
        elif ws.close_reason:
            said = f": {ws.close_reason}"
        meaning = CLOSE_MEANINGS.get(code) if code is not None else None
        level = logging.ERROR if code == 1009 else logging.WARNING
        logger.log(
            level,
            "orbit worker %s: connection closed by the server (code %s%s)%s; reconnecting",
            self._worker_id,
            code,
            f", {meaning}" if meaning else "",
            said,
        )

    async def _session(self, ws: ClientConnection) -> None:
        self._generation += 1
        conn = Connection(ws, self._generation)
        self.conn = self._closed_conn = conn
        reader = asyncio.create_task(self._read_loop(conn))
        try:
            try:
                reply = await self.raw_call(conn, self._hello)
                if reply.get("type") != "hello.ok":
                    code, message = error_code(reply), str(reply.get("message", ""))
                    if code in TRANSIENT_CODES:
                        # "Not now" (e.g. this worker_id is still in use by a live connection):
                        # the same hello can succeed later, so reconnect with backoff.
                        raise HelloRefused(f"hello answered {code}: {message}")
                    raise fatal(code, f"hello refused: {message}")
                self.session_id = reply.get("session_id") if isinstance(reply.get("session_id"), str) else None
                self.lease_seconds = seconds(reply.get("lease_seconds"), DEFAULT_LEASE_SECONDS)
                self.renew_seconds = seconds(reply.get("renew_seconds"), self.lease_seconds / 3)
                held = reply.get("held")
                await self._events.on_hello(conn, held if isinstance(held, list) else [])
            except NoAnswer:
                await asyncio.wait({reader}, timeout=CLOSE_TIMEOUT)
                if conn.fatal is not None:
                    raise conn.fatal from None
                raise
            conn.ready = True
            self._reconnect_delay = self._min_reconnect_delay
            self.ready.set()
            logger.info("orbit worker %s: connected (session %s)", self._worker_id, self.session_id)
            self._events.on_ready(conn)
            done_waiter = asyncio.create_task(self._done.wait())
            try:
                await asyncio.wait({reader, done_waiter}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                done_waiter.cancel()
            if conn.fatal is not None:
                raise conn.fatal
        finally:
            self._drop(conn)
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)

    def _drop(self, conn: Connection) -> None:
        conn.closed = True
        conn.ready = False
        if self.conn is conn:
            self.conn = None
            self.ready.clear()
        for future in conn.pending.values():
            if not future.done():
                future.set_exception(NoAnswer("connection closed"))
        conn.pending.clear()

    async def _read_loop(self, conn: Connection) -> None:
        try:
            async for message in conn.ws:
                self._dispatch(conn, message)
        except ConnectionClosed:
            pass
        finally:
            code = conn.ws.close_code
            if code in FATAL_CLOSE_CODES and conn.fatal is None:
                error = conn.last_error or {}
                said = error.get("message")
                message = said if isinstance(said, str) else f"closed with {code}"
                conn.fatal = fatal(error_code(error) if error else FATAL_CLOSE_CODES[code], message)
            self._drop(conn)

    def _dispatch(self, conn: Connection, message: str | bytes) -> None:
        try:
            frame = decoded(message)
        except ProtocolError as exc:
            logger.error("orbit worker %s: protocol error: %s", self._worker_id, exc)
            return
        reply_to = frame.get("reply_to")
        conn.error_was_last = reply_to is None and frame.get("type") == "error"
        if reply_to is not None:
            future = conn.pending.pop(reply_to, None) if isinstance(reply_to, str) else None
            if future is not None and not future.done():
                future.set_result(frame)
            elif frame.get("type") == "error":
                logger.warning("orbit worker %s: error for request %r: %s", self._worker_id, reply_to, frame)
            return
        kind = frame.get("type")
        if kind == "task.assign":
            self._events.on_assign(conn, frame)
        elif kind == "error":
            conn.last_error = frame
            logger.warning(
                "orbit worker %s: server error: %s %s", self._worker_id, frame.get("code"), frame.get("message")
            )
        else:
            logger.debug("orbit worker %s: ignoring frame of type %r", self._worker_id, kind)

    async def raw_call(self, conn: Connection, frame: dict[str, Any]) -> dict[str, Any]:
        """Send a request on ``conn`` and wait for its reply (or raise NoAnswer)."""
        if conn.closed:
            raise NoAnswer("connection closed")
        request_id = str(next(self._ids))
        loop = asyncio.get_running_loop()
        future: asyncio.Future[dict[str, Any]] = loop.create_future()
        conn.pending[request_id] = future
        try:
            try:
                await conn.ws.send(encoded(frame, request_id))
            except ConnectionClosed as exc:
                # Our own future first: nobody awaits it, and failing it would log
                # "Future exception was never retrieved".
                conn.pending.pop(request_id, None)
                self._drop(conn)
                if future.done() and not future.cancelled():
                    # The read loop's _drop failed it while the send waited for the close.
                    future.exception()
                raise NoAnswer("connection closed") from exc
            # A timer that fails the future itself: asyncio.wait_for adds a waiter future and
            # its callbacks to every answer (a timeout scope from Python 3.12 on).
            timer = loop.call_later(self._request_timeout, _no_reply, future, frame["type"], self._request_timeout)
            try:
                return await future
            finally:
                timer.cancel()
        finally:
            conn.pending.pop(request_id, None)

    async def call(self, frame: dict[str, Any], unless: Callable[[], bool] | None = None) -> dict[str, Any]:
        """Send once a connection is ready; ``unless`` is re-checked right before sending."""
        while True:
            await self.ready.wait()
            conn = self.conn
            if conn is not None and conn.ready:
                break
            await asyncio.sleep(0)
        if unless is not None and unless():
            raise Abandoned
        return await self.raw_call(conn, frame)

    async def send(self, conn: Connection, frame: dict[str, Any]) -> bool:
        """Send a frame that has no reply (task.assign.ack); False if the connection is gone."""
        try:
            await conn.ws.send(encoded(frame, str(next(self._ids))))
        except ConnectionClosed:
            return False
        return True

    def send_nowait(self, conn: Connection, frame: dict[str, Any]) -> None:
        """`send`, without waiting."""
        self._events.spawn(self.send(conn, frame))
