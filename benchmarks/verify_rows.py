"""What a verify of T rows costs against an AR step, end to end, on each target runner.

For each runner (`hf static`: transformers' forward on a StaticCache with an explicit mask, as
engine.target_kv runs it; `lean`: models.lean's fused forward, engine.target_kv), both as
CUDA graphs on a GPU: prefill `--context` tokens, then time, for T in `--rows`, what a round's
verify costs the host from launch to knowing the answer: the ids copied in, a tree of T rows
(four branches sharing row 0, as the engine's draft trees; T = 1 is the AR step), the replay, the
argmax read back to the host (the round's one synchronisation), and the crop back. Median of
`--reps` calls after warm-ups; also the device time of the replay alone (CUDA events).

    python benchmarks/verify_rows.py --gguf-dir DIR [--dtype bfloat16] [--context 512] \
        [--rows 1,2,4,8,16,32,48,64] [--reps 50] --out verify_rows.json
    python benchmarks/verify_rows.py --smoke --out /tmp/verify_rows_smoke.json   # CPU, a tiny random model

Prints a markdown table last: ms per verify, and the same in AR steps of that runner.
"""

from __future__ import annotations

import json

import torch

from common.cli import load_target, parser, setup
from common.random_models import random_model
from common.record import environment, write_json
from common.timing import verify_costs


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--smoke", action="store_true", help="CPU, a tiny random Llama")
    p.add_argument("--gguf-dir")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--rows", default="1,2,4,8,16,32,48,64")
    p.add_argument("--reps", type=int, default=50)
    args = p.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    cuda = torch.cuda.is_available() and not args.smoke
    from dominospec.engine.target_kv import HFForward, LeanForward, StaticTargetKV
    from dominospec.models.lean import DecoderOps, LeanDecoder

    if args.smoke:
        from transformers import LlamaConfig

        config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
        model = random_model(config)
        args.context, args.reps, rows = 48, 3, [r for r in rows if r <= 16]
        name = "tiny random llama"
    else:
        target = load_target(setup(args), args.gguf_dir, args.dtype)
        model, name = target.model, target.identity.name
    vocab = model.config.vocab_size
    capacity = args.context + max(rows) + 8
    result = dict(**environment(cuda), model=name, dtype=args.dtype if not args.smoke else "float32",
                  context=args.context, runners={})
    with torch.inference_mode():
        runners = {"hf static": lambda: StaticTargetKV(HFForward(model), [], capacity, max(rows), graphs=cuda),
                   "lean": lambda: StaticTargetKV(LeanForward(LeanDecoder(model, DecoderOps.on(cuda))), [], capacity,
                                                  max(rows), graphs=cuda)}
        for label, make in runners.items():
            result["runners"][label] = verify_costs(make(), vocab, args.context, rows, args.reps, cuda)
            print(f"{label}: {json.dumps(result['runners'][label])}", flush=True)
    write_json(args.out, result)
    print(f"\n{result['device']}, torch {result['torch']}, {name} {result['dtype']}, context {args.context}, "
          f"{result['date']}\n")
    print("| runner | " + " | ".join(f"T = {T}" for T in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for label, by_rows in result["runners"].items():
        step = by_rows[rows[0]]["wall_ms"]
        print(f"| {label}: wall ms (AR steps) | " + " | ".join(
            f"{v['wall_ms']:.3f} ({v['wall_ms'] / step:.2f})" for v in by_rows.values()) + " |")
        if cuda:
            print(f"| {label}: device ms | " + " | ".join(f"{v['device_ms']:.3f}" for v in by_rows.values()) + " |")


if __name__ == "__main__":
    main()
