"""The `dominospec` console script: one subcommand per pipeline stage, plus tools.

Every subcommand takes `--params PATH` (default `params.yaml`). A stage subcommand and
`python pipeline/<stage>.py --params params.yaml` (what dvc.yaml runs) call the same
library function, `fn(params: Params) -> None`.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Optional, Sequence

from dominospec.config import Params, load_params
from dominospec.stages import STAGES, resolve, report_user_errors, run_stage, stage_main  # noqa: F401 (stage_main: pipeline/)

def serve(params: Params, host: Optional[str] = None, port: Optional[int] = None, backend: Optional[str] = None,
          champion: bool = True) -> None:
    """`dominospec serve`: the backend is checked first (a launch that cannot run fails before the registry is
    read), then the draft is chosen (`with_champion`, unless `champion` is False or serve.mode is ar, which serves
    the target alone), then dominospec.serve.launch serves it. Here, because serve sits below retrain."""
    chosen = resolve("dominospec.serve.launch:resolve_backend")(backend or params.serve.backend, params.serve.mode,
                                                                 params.target)
    if champion and params.serve.mode != "ar":
        params = with_champion(params)
    resolve("dominospec.serve.launch:serve")(params, host=host, port=port, backend=chosen)


def with_champion(params: Params) -> Params:
    """Params -> the same params with `paths.draft` at the registry's champion draft (retrain.registered_model,
    alias `champion`, set by `dominospec retrain`), when there is one; says which draft is served."""
    champion = resolve("dominospec.retrain.registry:champion_draft")(params)
    if champion is None:
        print(f"serving {params.paths.draft} (no champion in the registry {params.mlflow.tracking_uri})", flush=True)
        return params
    print(f"serving {champion.model} version {champion.version} (champion) from {champion.path}", flush=True)
    return dataclasses.replace(params, paths=dataclasses.replace(params.paths, draft=str(champion.path)))


def print_preset(name: str, params: str) -> None:
    """`dominospec preset NAME`: apply it (dominospec.presets) and say which values changed."""
    changed = resolve("dominospec.presets:apply_preset")(name, params)
    print(f"{params}: preset {name}, {len(changed)} values changed" + "".join(f"\n  {key}" for key in changed))


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`dominospec <command> [--params PATH] ...`"""
    parser = argparse.ArgumentParser(prog="dominospec", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in STAGES:
        p = sub.add_parser(name, help=f"run the `{name}` stage")
        p.add_argument("--params", default="params.yaml")
    sub.choices["evaluate"].add_argument("--prompts", help="JSONL of {prompt} / {messages}: evaluate only this suite")
    sub.choices["evaluate"].add_argument("--out", help="write the report here (plots next to it) instead of metrics/")
    sub.choices["evaluate"].add_argument("--server", metavar="URL",
                                         help="evaluate a running server instead (out: metrics/serve_eval.json)")
    sub.choices["evaluate"].add_argument("--concurrency", type=int, metavar="N",
                                         help="with --server: requests in flight at the second level "
                                              "(default: evaluate.server_concurrency)")
    gen = sub.add_parser("generate", help="answer one prompt; print the answer, τ and tokens/s")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--mode", default="domino", choices=["ar", "ngram", "dflash", "domino", "dominotree"])
    gen.add_argument("--params", default="params.yaml")
    srv = sub.add_parser("serve", help="serve the final model (SGLang on a CUDA host, else the built-in server)")
    srv.add_argument("--params", default="params.yaml")
    srv.add_argument("--host", help="default: serve.host")
    srv.add_argument("--port", type=int, help="default: serve.port (0 = any free port, built-in server)")
    srv.add_argument("--backend", choices=["auto", "sglang", "builtin"], help="default: serve.backend")
    srv.add_argument("--no-champion", action="store_true",
                     help="serve paths.draft even when the registry has a champion (retrain.registered_model)")
    ret = sub.add_parser("retrain", help="new data snapshot, dvc repro, gate, register; the champion moves only "
                                         "on a pass (exit 0 promoted, 1 rejected, 2 failed)")
    ret.add_argument("--params", default="params.yaml")
    pre = sub.add_parser("preset", help="write params/NAME.yaml's overrides into params.yaml (checked first; "
                                        "`git checkout params.yaml` restores the default)")
    pre.add_argument("name", help="a preset in params/, e.g. qwen3-8b or smollm2-h200")
    pre.add_argument("--params", default="params.yaml")
    args = parser.parse_args(argv)
    if args.command == "evaluate" and args.concurrency is not None and not args.server:
        parser.error("--concurrency applies to --server only")
    if args.command == "evaluate" and args.server:
        served = resolve("dominospec.eval.served:evaluate_server")
        return report_user_errors(lambda: served(load_params(args.params), args.server, out=args.out, prompts=args.prompts,
                                   concurrency=args.concurrency))
    if args.command == "evaluate":
        evaluate = resolve(STAGES["evaluate"])
        return report_user_errors(lambda: evaluate(load_params(args.params), prompts=args.prompts, out=args.out))
    if args.command in STAGES:
        return report_user_errors(lambda: run_stage(args.command, args.params))
    if args.command == "generate":
        generate = resolve("dominospec.eval.generate:generate")
        return report_user_errors(lambda: generate(load_params(args.params), args.prompt, args.mode))
    if args.command == "serve":
        return report_user_errors(lambda: serve(load_params(args.params), host=args.host, port=args.port, backend=args.backend,
                                  champion=not args.no_champion))
    if args.command == "preset":
        return report_user_errors(lambda: print_preset(args.name, args.params))
    if args.command == "retrain":
        retrain = resolve("dominospec.retrain.job:retrain")
        report: dict = {}
        code = report_user_errors(lambda: report.update(retrain(load_params(args.params))))
        return code or (0 if report.get("decision") == "promoted" else 1)  # 1: the gate kept the champion
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
