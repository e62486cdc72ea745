"""``nimbus.data``: data between functions, kept where it is made.

::

    nimbus.put(obj, endpoint)  --> Ref  (the object in that endpoint's node store)
    ex.map(fn, xs, keep=True)  --> futures whose results stay where they were made
    ex.submit(g, ref, future)  --> g runs with the objects read where it runs (run())
    inside a task: nimbus.data.store()  (the user's key-value store there)
    ex.submit(fn, nimbus.File("lab:/data/x.h5"), out=nimbus.File("hpc:/r/{task_id}"))
                               --> fn gets pathlib.Paths: staged in, cached per node
                                   (``_file``); out= moved where it goes after the task

``store()`` (``_kv``): ``kv.set(k, v, ttl=DAY)`` / ``kv[k] = v``, ``kv.get(k, default)``
/ ``kv[k]``, ``kv.delete(k)``, ``k in kv``, ``kv.keys()``; str keys, picklable values; in
a task on an endpoint the user's keys there (in the store the service hands out), run
locally this runtime's.

Where data lives: a runtime's data directory, ``/dev/shm/nimbus-data-<uid>/r<hash of
its runtime dir>`` (``_node.default_root``): two runtimes (two ``NIMBUS_RUNTIME_DIR``)
never see each other's objects or keys; the agent holds it while the runtime runs and
it is removed when the last process holding it stops (the embedded runtime shut down,
the endpoint stopped).

What happens under each failure:

* the client dies: nobody renews its objects' leases (``LEASE``, 300 s); once they ran
  out, the next sweep removes them: every agent sweeps all of its user's runtimes on
  its node at start and every 10 s (a write to a store sweeps its runtime too), and
  removes the directory of a runtime whose processes all died once nothing in it is
  leased;
* the node or worker that kept an object loses it (a reboot, ``/dev/shm`` wiped): a task
  that reads it fails with ``ReferenceLost`` naming it, unless the task that made it is
  ``@nimbus.data.pure`` and known to this executor: then it runs again first;
* a task a future depends on fails: the dependent task fails and never runs: on an
  endpoint, where the service held it (a kept future of the same executor), with
  ``InputFailed`` naming the input's task id (its ``__cause__`` the input's error where
  the client has it), a cancelled input likewise; elsewhere with the input's own error
  (a cancelled input: ``InputFailed`` naming its task);
* the client exits after submitting a chain on an endpoint: the service holds and
  releases its tasks without it; results are there by task id (``Client.get_result``),
  kept objects until their leases run out;
* the endpoint that keeps an object goes offline (stopped: its objects went with it):
  reading it (``Ref.get``, a copy to another endpoint and the tasks waiting for it)
  fails at once with ``ReferenceLost`` naming it and the endpoint, and the read is
  cancelled at the service (``_watch``); ``Ref.get(timeout=)`` bounds any other wait;
* a Ref of another user, or of the local runtime passed to an endpoint: ``DataAccessError``
  at ``submit``, before any task runs (and again in the worker, for a Ref hidden deeper);
* a Ref of another endpoint (the same user): copied endpoint to endpoint before the task
  is sent (``_carry``, ``_direct``), once per target; a copy that fails (the source lost
  it: ``ReferenceLost``; a damaged transfer, a peer gone) fails the tasks waiting for it
  with that error, within ``_direct.TIMEOUT`` at most;
* a file staged between endpoints: sent by the source endpoint straight to the target's
  node cache, sha256 checked on arrival; when the source cannot connect to the target it
  travels through the client instead; any other failure fails the task with its error;
* a task on another node of that endpoint than the one holding the copy: it fetches the
  copy from that node's agent or block manager (``_serve``; ``_fetch``: the copy's
  secret, sha256 checked); that node gone, or the copy freed, before the task's node
  fetched it: the client stages the file again from its endpoint and sends the task
  again; with no source left (that endpoint offline, the file gone) the task fails with
  the staging's error, never a hang;

Whose data: on an endpoint, a task's user is the owner the service sends with it
(``nimbus.owners``): every token of a user sees the same store, another user's tasks
another, whatever scope a client puts in its tasks.

Limits: objects live in the store of the node that made them, so an endpoint of several
nodes reads them only where they were made (no copy between nodes yet for kept results
and ``put``; staged files are fetched between nodes, and so are objects relayed from
another endpoint: ``_serve``). A task given kept futures of its own executor on an
endpoint goes to the service at once, naming them (their task ids); so does one given
kept futures of another Executor of the same user on the same endpoint and service,
once the service accepted them; the service holds it until they succeed
(``nimbus.service.dependencies``), and its arguments name their results by the Refs
the client chose for them (``Scope.ref_id``): nothing of theirs passes through the
client (their Refs stay their own executor's: it must not shut down before the dependent
ran, as when the dependent waited in the client). A kept future of another endpoint (not
done) through the same service is relayed there (``_carry._relay``): the task's node
expects the object, a relay task on the future's endpoint, held by the service until the
future's task succeeded, sends it straight there, and the task is held by the service
until the relay succeeded; nothing of it waits in the client, and its data crosses only
the link between the endpoints. The object lands on the node that expected it; its Ref
names that node (its server, the pin's secret), so a task on another node of the endpoint
fetches it from there once (``_fetch.fetch_object``, sha256 checked, an HMAC of the
secret on it), and the pin, renewed and freed on that node as a staged copy's is, lives
as long as the copy is held (freeing it removes the object there). Other futures (not kept, of another service, not yet
accepted, done, or on the local runtime) are waited for in the client, as before (only
the "done" signal and the Ref pass through it, never the data).

Modules: ``_node`` (a node's object store: files in a private memory directory,
mapped on read, leases as modification times), ``_ref`` (``Ref``, the client's
sessions: counting, leases, freeing), ``_task`` (the worker side: resolving,
keeping, ``store()``), ``_kv`` (the key-value store), ``_file`` (``File``: staging,
exports, the node's file cache), ``_bind`` (the client side of a
task's arguments: dependencies, references, the session of an Executor), ``_submit``
(the Executor's data path: ``KeptFuture``, sending tasks at once or once their inputs are done,
making lost results of pure tasks again), ``_direct`` (bytes sent endpoint to endpoint:
a one-use connection the target offers), ``_serve`` (a node's file cache served to the
endpoint's other nodes), ``_fetch`` (what a node fetches from another's server),
``_carry`` (Refs of another endpoint copied to the task's) and ``_watch`` (the data
path's calls to an endpoint, failed when it is offline).
"""

from __future__ import annotations

from nimbus.data._bind import bind, open_session, uses_data, waiting_on, when_done
from nimbus.data._file import File
from nimbus.data._kv import EndpointKeyValue, KeyValue, NodeKeyValue
from nimbus.data._node import NodeStore, Sweeper, default_root
from nimbus.data._ref import LEASE, MAX_SCAN, Ref, Scope, Session, get, pure, put, register, session
from nimbus.data._staging import close_sources, has_files
from nimbus.data._staging import stage as stage_files
from nimbus.data._submit import DataPath, KeptFuture
from nimbus.data._task import endpoint_store, free_objects, identity, renew_objects, run, store

__all__ = [
    "LEASE",
    "MAX_SCAN",
    "DataPath",
    "EndpointKeyValue",
    "File",
    "KeptFuture",
    "KeyValue",
    "NodeKeyValue",
    "NodeStore",
    "Ref",
    "Scope",
    "Session",
    "Sweeper",
    "bind",
    "close_sources",
    "default_root",
    "endpoint_store",
    "free_objects",
    "get",
    "has_files",
    "identity",
    "open_session",
    "pure",
    "put",
    "register",
    "renew_objects",
    "run",
    "session",
    "stage_files",
    "store",
    "uses_data",
    "waiting_on",
    "when_done",
]
