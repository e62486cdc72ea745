"""The program of an Executor's tasks on an endpoint: they message each other through it.

::

    Executor.__init__ --> EndpointProgram.start(): a thread asks the service for the
        endpoint's store (handout.hand_out: POST /v1/endpoints/{id}/store), under this
        user's key prefix, and keeps the program's keys alive (statestore.Root)
    Executor's first task --> row(): waits for the service's answer (not for the PING
        of the store from here, which may take its timeout: a plain task needs no store);
        every task carries the row (statestore.Program.row(), or why there is none) and
        its worker joins it
    Executor.messaging() --> program(): waits for the PING too (raises its error)
    ServiceBackend.shutdown --> close(): the program's keys are deleted

The store is the one ``nimbus.multiprocessing`` uses on that endpoint: the
service's Redis, reached as an ACL user of this user's that may touch only keys
under the user's prefix, so another user's tasks cannot read this program's
token or messages. If the service cannot hand one out, the tasks still run:
only those that use messaging fail, with the reason.
"""

from __future__ import annotations

import threading

from nimbus.backends.handout import hand_out, probe_store
from nimbus.client import Client
from nimbus.config import Settings
from nimbus.errors import StateStoreError
from nimbus.statestore import Keys, Program, Root, StateStore

__all__ = ["EndpointProgram"]


class EndpointProgram:
    """The program of one Executor's tasks on ``endpoint``, owned by the Executor."""

    def __init__(self, client: Client, endpoint: str, settings: Settings) -> None:
        self._client = client
        self._endpoint = endpoint
        self._key_ttl = settings.key_ttl
        self._root: Root | None = None
        self._row: object = None
        self._answered = threading.Event()  # _row is set
        self._unreachable = ""  # why this process cannot reach the store handed out
        self._closed = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._open, name="nimbus-program", daemon=True)

    def start(self) -> None:
        """Ask the service for it now, on a thread (:meth:`row` waits for it)."""
        self._thread.start()

    def _open(self) -> None:
        try:
            handed = hand_out(self._client, self._endpoint, probe=False)
            program_id = f"{handed.key_prefix}.{Keys.program_id_new()}"
            prog = Program(handed.url, program_id, self._key_ttl, True, endpoint=self._endpoint)
            with self._lock:
                if self._closed:
                    return
                self._root = Root(StateStore(handed.url), prog)
            self._row = prog.row()
        except Exception as exc:  # (NimbusError, or the service client's own): said per task
            self._row = (
                f"the tasks of this executor have no program to message each other in: the "
                f"service did not hand out a state store for endpoint {self._endpoint!r} "
                f"({exc})"
            )
            return
        finally:
            self._answered.set()
        try:
            probe_store(handed.url, self._endpoint)
        except Exception as exc:  # (StateStoreError, ConfigError): said by program()
            self._unreachable = str(exc)

    def row(self) -> object:
        """What each task carries: the program's row, or why there is none."""
        if self._thread.ident is None:
            self.start()
        self._answered.wait()
        return self._row

    def program(self) -> Program | None:
        """The program, once handed out and reached from here (None: it was not handed
        out; StateStoreError: this process cannot reach it)."""
        self.row()
        self._thread.join()
        if self._unreachable:
            raise StateStoreError(self._unreachable)
        root = self._root
        return root.program if root is not None else None

    def close(self) -> None:
        """Delete the program's keys and stop keeping them alive."""
        if self._thread.ident is not None:
            self._thread.join(30)  # (a handout under way ends first: about one round trip)
        with self._lock:
            self._closed = True
            root, self._root = self._root, None
        if root is not None:
            root.close()
