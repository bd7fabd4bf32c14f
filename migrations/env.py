"""Alembic environment for the ulyssesd store.

Deliberately no `logging.config.fileConfig`: the daemon's structlog setup must stay in charge.
Normally run through `ulyssesd.daemon.store.migrate` (which passes an open connection with our pragmas
in `config.attributes["connection"]`); the `alembic` CLI with migrations/alembic.ini also works for
developers (it builds an engine from `sqlalchemy.url`).
"""

from __future__ import annotations

from alembic import context

from ulyssesd.daemon.store.models import Base

config = context.config
target_metadata = Base.metadata


def _configure_and_run(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        # SQLite cannot ALTER most things: batch mode recreates the table (copy, drop, rename).
        render_as_batch=True,
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure_and_run(connection)
        return
    from ulyssesd.daemon.store.engine import make_engine

    url = config.get_main_option("sqlalchemy.url") or ""
    prefix = "sqlite:///"
    if not url.startswith(prefix):
        raise RuntimeError(f"sqlalchemy.url must be sqlite:///PATH, got {url!r}")
    engine = make_engine(url[len(prefix):], foreign_keys=False)
    try:
        with engine.connect() as conn:
            _configure_and_run(conn)
    finally:
        engine.dispose()


if context.is_offline_mode():
    raise RuntimeError("offline (--sql) migrations are not supported for the ulyssesd store")
run_migrations_online()
