"""The registry's tables: users, tokens, revocations, functions, endpoints, shares.

SQLAlchemy 2 declarative models on one :class:`Base`, whose metadata
``nimbus.service.registry.Registry`` creates; columns added after a table was
first made are also listed in ``nimbus.service.migrate``. Ids are UUID4 strings
(:func:`new_id`); a token is stored as its SHA-256 digest, never as itself.
"""

from __future__ import annotations

import time
import uuid

from sqlalchemy import Boolean, Float, ForeignKey, LargeBinary, String, Text, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

__all__ = ["Base", "Endpoint", "Function", "Revocation", "Share", "Token", "User", "new_id"]


def new_id() -> str:
    return str(uuid.uuid4())


class Base(DeclarativeBase):
    pass


class User(Base):
    __tablename__ = "users"
    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    created: Mapped[float] = mapped_column(Float, default=time.time)


class Token(Base):
    __tablename__ = "tokens"
    digest: Mapped[str] = mapped_column(String(64), primary_key=True)
    user_id: Mapped[str] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"))
    endpoint_id: Mapped[str | None] = mapped_column(String(36), nullable=True, index=True)
    created: Mapped[float] = mapped_column(Float, default=time.time)


class Revocation(Base):
    """A revoked token's digest, so that a running service drops it at once."""

    __tablename__ = "revocations"
    digest: Mapped[str] = mapped_column(String(64), primary_key=True)
    revoked: Mapped[float] = mapped_column(Float, default=time.time, index=True)
    # the user whose own (not an endpoint's) token this was: their store credentials go too
    user_id: Mapped[str | None] = mapped_column(String(36), nullable=True)


class Function(Base):
    __tablename__ = "functions"
    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    owner_id: Mapped[str] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(200))
    digest: Mapped[str] = mapped_column(String(64), index=True)
    body: Mapped[bytes] = mapped_column(LargeBinary)
    python: Mapped[str] = mapped_column(String(16))
    serializer: Mapped[str] = mapped_column(String(64))
    public: Mapped[bool] = mapped_column(Boolean, default=False)
    created: Mapped[float] = mapped_column(Float, default=time.time)
    # the environment its tasks run in unless a call gives another: the JSON of
    # Environment.to_dict() (keys sorted), NULL for the endpoint workers' own Python
    environment: Mapped[str | None] = mapped_column(Text, nullable=True)


class Endpoint(Base):
    __tablename__ = "endpoints"
    __table_args__ = (UniqueConstraint("owner_id", "name"),)
    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    owner_id: Mapped[str] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(200))
    public: Mapped[bool] = mapped_column(Boolean, default=False)
    created: Mapped[float] = mapped_column(Float, default=time.time)


class Share(Base):
    __tablename__ = "shares"
    kind: Mapped[str] = mapped_column(String(16), primary_key=True)  # function | endpoint
    resource_id: Mapped[str] = mapped_column(String(36), primary_key=True)
    user_id: Mapped[str] = mapped_column(
        ForeignKey("users.id", ondelete="CASCADE"), primary_key=True
    )
