"""Errors the store raises; all derive from StoreError so callers can catch one type."""

from __future__ import annotations


class StoreError(Exception):
    """Base class of every store error."""


class NoDatabaseError(StoreError):
    """Read-only open of a database file that does not exist (or has no schema) yet."""


class ReadOnlyStoreError(StoreError):
    """A write method was called on a store opened read-only."""


class SchemaMismatchError(StoreError):
    """The database's Alembic revision is not the one this code expects."""


class NotFoundError(StoreError, LookupError):
    """The run/incident/action/... asked for does not exist."""


class InvalidValueError(StoreError, ValueError):
    """A value (enum string, timestamp, ...) was rejected before reaching the database."""
