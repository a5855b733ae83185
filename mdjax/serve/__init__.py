"""Serving: an engine that batches requests step by step over the compiled sampler step
(`engine`), an OpenAI-compatible HTTP app over it (`app`), the live views (`page.html`,
`terminal`). `python -m mdjax.serve --model=PATH` starts a server (docs/serving.md)."""
