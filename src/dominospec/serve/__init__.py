"""Serving the final model: `dominospec serve` / `make serve`.

On a CUDA host with the `sglang` package, stock SGLang serves the exported draft (DFLASH + the
Domino head); elsewhere the built-in server answers the same OpenAI-compatible subset with
dominospec's own engine (lossless: greedy answers equal the target's own greedy decoding).

  launch.py     choose the backend, then exec SGLang or run the built-in server
  sglang.py     whether SGLang can run here, and exec into it (its command line: export.sglang_launch)
  builtin.py    load target + draft, bind, run uvicorn
  app.py        the routes
  service.py    request -> checks -> queued job -> JSON answer or SSE stream
  worker.py     the one engine thread and its bounded queue
  requests.py   request bodies: parsing and validation
  responses.py  OpenAI bodies, SSE chunks, SGLang's meta_info
  streaming.py  token ids -> text deltas that never pass a stop string
  guards.py     bearer key and body size, before any parsing
  errors.py     OpenAI-shaped error bodies
"""

from dominospec.serve.launch import resolve_backend, serve

__all__ = ["resolve_backend", "serve"]
