"""Alembic migrations for the holdback schema."""
