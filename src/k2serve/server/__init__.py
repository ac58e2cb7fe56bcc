"""The OpenAI-compatible HTTP server (`k2serve serve`): `build_app(engine, ...)` in `app`."""
