"""The HTTP API: `create_app()` (firsttoken.api.app) and its routers, one module per resource."""

from firsttoken.api.app import ConfigError, create_app

__all__ = ["ConfigError", "create_app"]
