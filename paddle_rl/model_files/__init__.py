"""Model files without Paddle: safetensors reading and writing, GGUF conversion, models fetchable without a hub.

Nothing here imports Paddle or another package of the project, so `paddle-rl fetch` / `paddle-rl convert` (and
their parsers under `paddle-rl --help`) start without it.
"""
