"""Hearth's OpenAPI document (`GET /openapi.json`): drf-spectacular generates it from the URLconf,
and `hooks.describe_api` fills in what introspection cannot know (the async views, every
operation's bodies and errors) from `operations.py`, on the schemas of `schemas.py` and the
vendored subset of OpenAI's own spec (`openai_subset.json`, written by `vendor.py`)."""
