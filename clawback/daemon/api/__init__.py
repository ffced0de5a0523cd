"""The daemon's HTTP API: OpenAI-compatible chat completions with real streaming, and its own routes
(feedback, adapters, memory, status, the dashboard).

Modules: protocol (request bodies), serving (chat completions), *_routes (the other routes), auth
(bearer auth in front of them all), state (AppState), app (assembles the FastAPI app)."""

from .app import create_app
from .auth import BearerAuth
from .errors import ApiError
from .state import AppState, resolve_api_key

__all__ = ["ApiError", "AppState", "BearerAuth", "create_app", "resolve_api_key"]
