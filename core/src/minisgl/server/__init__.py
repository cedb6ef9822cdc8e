"""The OpenAI-compatible server: settings and CLI, launcher, worker processes and the FastAPI app.

Nothing is imported here, so ``minisgl serve --help`` stays fast.
"""
