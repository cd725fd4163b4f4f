"""The ground floor of the gateway's settings: the base of every config model and the error a bad config raises."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """The configuration file cannot be used; the message says which key to change."""


class SettingsModel(BaseModel):
    """A section of the gateway's config: unknown keys refused, camelCase names or their aliases, immutable."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)
