"""The service's registry: users, tokens, functions, endpoints and shares.

SQLAlchemy 2 on SQLite by default (``Settings.registry_url``) or PostgreSQL by
URL; the tables are ``nimbus.service.tables``. Tokens are stored as SHA-256 hashes; a token is shown once, when made.
Function bodies are stored as the bytes the client sent: the registry never
unpickles them. Calls are synchronous; the app runs them in a thread pool.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, delete, event, func, or_, select
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.orm import Session, sessionmaker

from nimbus.errors import QuotaExceeded
from nimbus.service.migrate import add_columns
from nimbus.service.tables import Base, Endpoint, Function, Revocation, Share, Token, User, new_id

__all__ = ["Principal", "Registry", "TokenInfo", "check_user_name", "hash_token"]

TOKEN_PREFIX = "nimbus_"
TOKEN_ID_CHARS = 12  # a token's ID: the start of its digest
MIN_ID_CHARS = 6


_USER_NAME = re.compile(r"[A-Za-z0-9_.@-]{1,200}")  # as an endpoint's name


def check_user_name(name: str) -> str:
    """``name`` if it may name a user; ``ValueError`` saying what is accepted otherwise."""
    if not isinstance(name, str) or not _USER_NAME.fullmatch(name):
        raise ValueError(
            f"{name!r} is not a user name: 1-200 letters, digits, '_', '.', '@' or '-'"
        )
    return name


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class Principal:
    """Who a token belongs to; ``endpoint_id`` is set for an endpoint's own token."""

    user_id: str
    user_name: str
    endpoint_id: str | None = None


@dataclass(frozen=True)
class TokenInfo:
    """A token as ``nimbus service token list`` shows it (never the token itself)."""

    id: str  # the first TOKEN_ID_CHARS of its digest
    user: str
    endpoint: str  # the endpoint's name for an agent's token, else ""
    created: float


@dataclass(frozen=True)
class FunctionInfo:
    id: str
    owner_id: str
    owner: str
    name: str
    python: str
    serializer: str
    public: bool
    created: float
    shared_with: tuple[str, ...]
    shared_ids: frozenset[str] = frozenset()  # the user ids of ``shared_with``
    environment: dict[str, Any] | None = None  # Environment.to_dict(), None: the workers' own

    def usable_by(self, user_id: str) -> bool:
        """Whether the user ``user_id`` may run this function (own, shared or public)."""
        return self.public or user_id == self.owner_id or user_id in self.shared_ids

    def as_dict(self) -> dict[str, object]:
        return {
            "function_id": self.id,
            "owner": self.owner,
            "name": self.name,
            "python": self.python,
            "serializer": self.serializer,
            "public": self.public,
            "created": self.created,
            "shared_with": list(self.shared_with),
            "environment": self.environment,
        }


@dataclass(frozen=True)
class EndpointInfo:
    id: str
    owner_id: str
    owner: str
    name: str
    public: bool
    created: float
    shared_with: tuple[str, ...]

    def as_dict(self) -> dict[str, object]:
        return {
            "endpoint_id": self.id,
            "owner": self.owner,
            "name": self.name,
            "public": self.public,
            "created": self.created,
            "shared_with": list(self.shared_with),
        }


class Registry:
    """The registry database; ``Registry(url)`` creates the tables it lacks."""

    def __init__(self, url: str) -> None:
        parsed = make_url(url)
        if parsed.drivername.startswith("sqlite"):
            if parsed.database and parsed.database != ":memory:":
                Path(parsed.database).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            self.engine: Engine = create_engine(url, connect_args={"check_same_thread": False})
            event.listen(self.engine, "connect", _sqlite_pragmas)
        else:
            if parsed.drivername in ("postgresql", "postgres"):
                parsed = parsed.set(drivername="postgresql+psycopg")
            self.engine = create_engine(parsed, pool_pre_ping=True)
        Base.metadata.create_all(self.engine)
        add_columns(self.engine)
        self._session = sessionmaker(self.engine, expire_on_commit=False)

    def close(self) -> None:
        self.engine.dispose()

    # ------------------------------------------------------------ users and tokens

    def create_user_token(self, name: str) -> str:
        """A new token for user ``name`` (created if new); returned once, stored hashed.

        Raises ``ValueError`` for a name :func:`check_user_name` refuses.
        """
        check_user_name(name)
        token = TOKEN_PREFIX + secrets.token_urlsafe(32)
        with self._session.begin() as session:
            user = session.scalar(select(User).where(User.name == name))
            if user is None:
                user = User(id=new_id(), name=name)
                session.add(user)
                session.flush()
            session.add(Token(digest=hash_token(token), user_id=user.id))
        return token

    def create_endpoint_token(self, user_id: str, endpoint_id: str) -> tuple[str, list[str]]:
        """A new credential for an endpoint's agent, and the digests of the older ones it
        replaces: they are revoked (recorded, so that every running service drops them)."""
        token = TOKEN_PREFIX + "ep_" + secrets.token_urlsafe(32)
        with self._session.begin() as session:
            replaced = self._revoke_endpoint_tokens(session, endpoint_id)
            session.add(Token(digest=hash_token(token), user_id=user_id, endpoint_id=endpoint_id))
        return token, replaced

    @staticmethod
    def _revoke_endpoint_tokens(session: Session, endpoint_id: str) -> list[str]:
        digests = list(
            session.scalars(select(Token.digest).where(Token.endpoint_id == endpoint_id))
        )
        session.execute(delete(Token).where(Token.digest.in_(digests)))
        now = time.time()
        for digest in digests:
            session.merge(Revocation(digest=digest, revoked=now, user_id=None))
        return digests

    def principal(self, token: str) -> Principal | None:
        with self._session() as session:
            row = session.execute(
                select(Token.user_id, User.name, Token.endpoint_id)
                .join(User, User.id == Token.user_id)
                .where(Token.digest == hash_token(token))
            ).first()
        return None if row is None else Principal(row[0], row[1], row[2])

    def tokens(self) -> list[TokenInfo]:
        """Every token, oldest first."""
        with self._session() as session:
            rows = session.execute(
                select(Token.digest, User.name, Endpoint.name, Token.created)
                .join(User, User.id == Token.user_id)
                .outerjoin(Endpoint, Endpoint.id == Token.endpoint_id)
                .order_by(Token.created)
            ).all()
        return [
            TokenInfo(d[:TOKEN_ID_CHARS], user, ep or "", created) for d, user, ep, created in rows
        ]

    def revoke(self, name_or_id: str) -> list[TokenInfo]:
        """Revoke every token of user ``name_or_id``, or the one token with that ID; what went.

        Raises LookupError naming what is wrong when neither matches (or an ID is ambiguous).
        """
        with self._session.begin() as session:
            query = (
                select(
                    Token.digest,
                    User.name,
                    Endpoint.name,
                    Token.created,
                    Token.user_id,
                    Token.endpoint_id,
                )
                .join(User, User.id == Token.user_id)
                .outerjoin(Endpoint, Endpoint.id == Token.endpoint_id)
            )
            user = session.scalar(select(User.id).where(User.name == name_or_id))
            if user is not None:
                rows = session.execute(query.where(Token.user_id == user)).all()
            elif len(name_or_id) >= MIN_ID_CHARS and all(
                c in "0123456789abcdef" for c in name_or_id
            ):
                rows = session.execute(query.where(Token.digest.startswith(name_or_id))).all()
                if not rows:
                    raise LookupError(f"no token with ID {name_or_id}")
                if len(rows) > 1:
                    raise LookupError(f"token ID {name_or_id} is ambiguous: give more of it")
            else:
                raise LookupError(
                    f"no user named {name_or_id!r}, and it is not a token ID (at least "
                    f"{MIN_ID_CHARS} hex digits)"
                )
            digests = [row[0] for row in rows]
            session.execute(delete(Token).where(Token.digest.in_(digests)))
            now = time.time()
            for digest, *_, user_id, endpoint_id in rows:
                owner = user_id if endpoint_id is None else None
                session.merge(Revocation(digest=digest, revoked=now, user_id=owner))
        return [
            TokenInfo(d[:TOKEN_ID_CHARS], u, ep or "", created) for d, u, ep, created, *_ in rows
        ]

    def revoked_since(self, since: float) -> list[tuple[str, float, str | None]]:
        """``(digest, when, user id)`` of the tokens revoked after ``since``; the user
        id is given for a user's own token (not an endpoint's)."""
        with self._session() as session:
            rows = session.execute(
                select(Revocation.digest, Revocation.revoked, Revocation.user_id).where(
                    Revocation.revoked > since
                )
            ).all()
        return [(digest, when, user_id) for digest, when, user_id in rows]

    def user_ids(self, names: list[str]) -> dict[str, str]:
        with self._session() as session:
            rows = session.execute(select(User.name, User.id).where(User.name.in_(names)))
            return {name: uid for name, uid in rows}

    # ------------------------------------------------------------ functions

    def add_function(
        self,
        owner_id: str,
        name: str,
        body: bytes,
        python: str,
        serializer: str,
        *,
        limit: int | None = None,
        environment: dict[str, Any] | None = None,
        wraps: str | None = None,
    ) -> str:
        """Register a function; the same bytes from the same owner give the same id.

        With an ``environment`` (``Environment.to_dict()``) the function's tasks run in
        it unless a call gives another: the same bytes in another environment are
        another function (an id's environment never changes). Without one, the owner's
        latest registration of these bytes is found, whatever its environment, so an
        SDK registering on first use gets the environment its owner registered; if
        there is none, the environment of the owner's latest registration of the pickle
        of SHA-256 ``wraps`` (the function these bytes wrap: an executor's scope) is given.

        :class:`~nimbus.errors.QuotaExceeded` (429) if the owner already has ``limit``
        functions (``NIMBUS_MAX_FUNCTIONS``) and these bytes are not one of them.
        """
        digest = hashlib.sha256(body).hexdigest()
        env = None if environment is None else _env_json(environment)
        with self._session.begin() as session:
            query = select(Function.id).where(
                Function.owner_id == owner_id,
                Function.digest == digest,
                Function.python == python,
                Function.serializer == serializer,
            )
            if env is not None:
                query = query.where(Function.environment == env)
            existing = session.scalar(query.order_by(Function.created.desc()).limit(1))
            if existing is not None:
                return existing
            if env is None and wraps:
                env = session.scalar(
                    select(Function.environment)
                    .where(
                        Function.owner_id == owner_id,
                        Function.digest == wraps,
                        Function.python == python,
                        Function.serializer == serializer,
                    )
                    .order_by(Function.created.desc())
                    .limit(1)
                )
            if limit is not None:
                _check_count(
                    session, Function, owner_id, limit, "functions", "NIMBUS_MAX_FUNCTIONS"
                )
            fn = Function(
                id=new_id(),
                owner_id=owner_id,
                name=name,
                digest=digest,
                body=body,
                python=python,
                serializer=serializer,
                environment=env,
            )
            session.add(fn)
            return fn.id

    def function(self, function_id: str) -> FunctionInfo | None:
        with self._session() as session:
            row = session.execute(
                select(Function, User.name)
                .join(User, User.id == Function.owner_id)
                .where(Function.id == function_id)
            ).first()
            if row is None:
                return None
            fn, owner = row
            shared = self._sharers(session, "function", fn.id)
            return FunctionInfo(
                fn.id,
                fn.owner_id,
                owner,
                fn.name,
                fn.python,
                fn.serializer,
                fn.public,
                fn.created,
                tuple(name for name, _ in shared),
                frozenset(uid for _, uid in shared),
                None if fn.environment is None else json.loads(fn.environment),
            )

    def function_body(self, function_id: str) -> bytes | None:
        with self._session() as session:
            body: bytes | None = session.scalar(
                select(Function.body).where(Function.id == function_id)
            )
            return body

    def functions(self, user_id: str) -> list[FunctionInfo]:
        with self._session() as session:
            ids = session.scalars(
                select(Function.id)
                .where(self._visible(Function, "function", user_id))
                .order_by(Function.created)
            ).all()
        return [info for fid in ids if (info := self.function(fid)) is not None]

    def delete_function(self, function_id: str) -> None:
        with self._session.begin() as session:
            session.execute(delete(Function).where(Function.id == function_id))
            session.execute(
                delete(Share).where(Share.kind == "function", Share.resource_id == function_id)
            )

    # ------------------------------------------------------------ endpoints

    def add_endpoint(
        self, owner_id: str, name: str, *, limit: int | None = None
    ) -> tuple[str, bool]:
        """The id of the owner's endpoint ``name``, created if new, and whether it was.

        :class:`~nimbus.errors.QuotaExceeded` (429) if it is new and the owner already
        has ``limit`` endpoints (``NIMBUS_MAX_ENDPOINTS``).
        """
        with self._session.begin() as session:
            existing = session.scalar(
                select(Endpoint.id).where(Endpoint.owner_id == owner_id, Endpoint.name == name)
            )
            if existing is not None:
                return existing, False
            if limit is not None:
                _check_count(
                    session, Endpoint, owner_id, limit, "endpoints", "NIMBUS_MAX_ENDPOINTS"
                )
            endpoint = Endpoint(id=new_id(), owner_id=owner_id, name=name)
            session.add(endpoint)
        return endpoint.id, True

    def endpoint(self, endpoint_id: str) -> EndpointInfo | None:
        with self._session() as session:
            row = session.execute(
                select(Endpoint, User.name)
                .join(User, User.id == Endpoint.owner_id)
                .where(Endpoint.id == endpoint_id)
            ).first()
            if row is None:
                return None
            ep, owner = row
            return EndpointInfo(
                ep.id,
                ep.owner_id,
                owner,
                ep.name,
                ep.public,
                ep.created,
                self._shared_with(session, "endpoint", ep.id),
            )

    def endpoints(
        self, user_id: str, name: str | None = None, owner: str | None = None
    ) -> list[EndpointInfo]:
        """Endpoints ``user_id`` can see (own first), optionally only those called ``name``
        and only those of the user named ``owner``."""
        query = select(Endpoint.id, Endpoint.owner_id).where(
            self._visible(Endpoint, "endpoint", user_id)
        )
        if name is not None:
            query = query.where(Endpoint.name == name)
        if owner is not None:
            query = query.join(User, User.id == Endpoint.owner_id).where(User.name == owner)
        with self._session() as session:
            rows = list(session.execute(query.order_by(Endpoint.created)).all())
        rows.sort(key=lambda row: row[1] != user_id)
        return [info for eid, _ in rows if (info := self.endpoint(eid)) is not None]

    def delete_endpoint(self, endpoint_id: str) -> list[str]:
        """Delete an endpoint, its shares and its agent's tokens (revoked); their digests."""
        with self._session.begin() as session:
            session.execute(delete(Endpoint).where(Endpoint.id == endpoint_id))
            revoked = self._revoke_endpoint_tokens(session, endpoint_id)
            session.execute(
                delete(Share).where(Share.kind == "endpoint", Share.resource_id == endpoint_id)
            )
        return revoked

    # ------------------------------------------------------------ sharing

    def share(
        self,
        kind: str,
        resource_id: str,
        user_ids: list[str],
        public: bool | None,
        remove: Sequence[str] = (),
    ) -> None:
        """Share with ``user_ids``, stop sharing with ``remove``, set ``public`` if given."""
        model: type[Function] | type[Endpoint] = Function if kind == "function" else Endpoint
        with self._session.begin() as session:
            if public is not None:
                obj: Any = session.get(model, resource_id)
                if obj is not None:
                    obj.public = public
            if remove:
                session.execute(
                    delete(Share).where(
                        Share.kind == kind,
                        Share.resource_id == resource_id,
                        Share.user_id.in_(list(remove)),
                    )
                )
            for uid in user_ids:
                if session.get(Share, (kind, resource_id, uid)) is None:
                    session.add(Share(kind=kind, resource_id=resource_id, user_id=uid))

    @staticmethod
    def _visible(model: type[Function] | type[Endpoint], kind: str, user_id: str) -> Any:
        shared = select(Share.resource_id).where(Share.kind == kind, Share.user_id == user_id)
        return or_(model.owner_id == user_id, model.public.is_(True), model.id.in_(shared))

    @staticmethod
    def _shared_with(session: Session, kind: str, resource_id: str) -> tuple[str, ...]:
        return tuple(name for name, _ in Registry._sharers(session, kind, resource_id))

    @staticmethod
    def _sharers(session: Session, kind: str, resource_id: str) -> list[tuple[str, str]]:
        """The users a resource is shared with, as ``(name, id)``, by name."""
        rows = session.execute(
            select(User.name, User.id)
            .join(Share, Share.user_id == User.id)
            .where(Share.kind == kind, Share.resource_id == resource_id)
            .order_by(User.name)
        )
        return [(name, user_id) for name, user_id in rows]


def _check_count(
    session: Session,
    model: type[Function] | type[Endpoint],
    owner_id: str,
    limit: int,
    what: str,
    setting: str,
) -> None:
    """QuotaExceeded (429) naming ``setting`` if ``owner_id`` has ``limit`` ``what`` already."""
    have = session.scalar(select(func.count()).select_from(model).where(model.owner_id == owner_id))
    if have is not None and have >= limit:
        raise QuotaExceeded(
            f"quota: you have {have} {what} registered and may have at most {limit} "
            f"({setting} on the service); delete some you no longer use",
            429,
        )


def _env_json(environment: dict[str, Any]) -> str:
    """An environment as stored: its JSON with sorted keys, so equal specs compare equal."""
    return json.dumps(environment, sort_keys=True, separators=(",", ":"))


def _sqlite_pragmas(dbapi_connection: object, record: object) -> None:
    del record
    cursor = dbapi_connection.cursor()  # type: ignore[attr-defined]
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()
