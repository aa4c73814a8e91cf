"""Load on a running OpenAI-compatible server: N concurrent clients, M requests each, p50/p99 latency.

    python benchmarks/load.py --url http://127.0.0.1:8000 --clients 4 --requests 8 --max-tokens 32

Each client is a thread with its own keep-alive connection; it sends its M requests one after the
other, alternating non-streaming and streaming (`--stream-every 2`: every 2nd is streamed), greedy,
cycling through the prompts. Latency is send -> last byte (a stream's [DONE]); throughput is
completed requests and completion tokens per wall-clock second of the whole run. Statuses other
than 200 are counted by code (503 = queue full), never retried. The load is `common.http_load.run_load`,
which tests/serve/test_load.py runs against a tiny served model.
"""

from __future__ import annotations

import json
import os

from common.cli import parser
from common.http_load import run_load


def main() -> None:
    p = parser(__doc__, params=None)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--requests", type=int, default=8, help="per client")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--stream-every", type=int, default=2, help="every n-th request streams; 0 = none")
    p.add_argument("--api-key-env", default="DOMINOSPEC_API_KEY")
    args = p.parse_args()
    result = run_load(args.url, args.clients, args.requests, args.max_tokens, stream_every=args.stream_every,
                      api_key=os.environ.get(args.api_key_env) or None)
    print(json.dumps(result.summary(), indent=2))


if __name__ == "__main__":
    main()
