"""The `card` stage: the exported draft's model card (paths.draft/README.md), written after the evaluation it quotes.

Reads   paths.draft/config.json, model.safetensors     what the card describes; the weights' sha256 names them
        paths.metrics/prepare.json, cache.json, train.json      the data and the training
        paths.metrics/eval.json, serve_eval.json, headline.json  this run's evaluation
Writes  paths.draft/README.md (atomically), so that the exported directory, uploaded as it is, carries its card

dvc.yaml runs it after headline. An evaluation document is quoted only when it describes these weights:
eval.json and serve_eval.json by their `draft_sha256`, headline.json by equalling the rows `eval.headline`
computes from those two. A missing document, or one of another draft, is named with what to re-run instead
of quoted: a card written before evaluate (`dominospec card` right after `dominospec export`) says the draft
awaits its evaluation, and never shows an older draft's numbers.
"""

from __future__ import annotations

from pathlib import Path

from dominospec.card.render import Measured, Quoted, model_card
from dominospec.config import Params
from dominospec.errors import UserError
from dominospec.eval.headline import headline_rows, read_json
from dominospec.export.contract import CARD_FILE, WEIGHTS_FILE, check_export_dir
from dominospec.export.sglang_launch import read_draft_config
from dominospec.files import sha256_file, write_atomic


def card(params: Params) -> str:
    """Params -> paths.draft/README.md (written), its text returned."""
    draft = Path(params.paths.draft)
    exported = read_draft_config(draft)
    problems = check_export_dir(draft)
    if problems:
        raise UserError(f"paths.draft: {draft} is not a complete export ({'; '.join(problems)}): run `dvc repro export`")
    weights_sha256 = sha256_file(draft / WEIGHTS_FILE)
    metrics = Path(params.paths.metrics)
    engine = describing(metrics / "eval.json", weights_sha256, "evaluate")
    served = describing(metrics / "serve_eval.json", weights_sha256, "serve_eval")
    headline = headline_of(metrics, engine, served, params.headline.digits)
    text = model_card(params, exported, weights_sha256, Measured(headline=headline, engine=engine, served=served))
    write_atomic(draft / CARD_FILE, text.encode())
    quoted = [name for name, doc in (("eval.json", engine), ("serve_eval.json", served), ("headline.json", headline))
              if isinstance(doc, dict)]
    print(f"card: {draft / CARD_FILE} (weights sha256 {weights_sha256[:12]}; quotes {', '.join(quoted) or 'no evaluation'})")
    return text


def describing(path: Path, weights_sha256: str, stage: str) -> Quoted:
    """A metrics file with `draft_sha256` -> its document when it names these weights, else why it is not quoted."""
    if not path.is_file():
        return (f"Not measured yet: the {stage} stage measures this export after it is written and records its "
                f"weights' sha256 in `{path}` (`dvc repro`).")
    document = read_json(path)
    named = document.get("draft_sha256")
    if named != weights_sha256:
        return (f"Not quoted: `{path}` describes draft weights {str(named)[:12]}, not these ({weights_sha256[:12]}); "
                f"re-run the {stage} stage (`dvc repro`) to measure them.")
    return document


def headline_of(metrics: Path, engine: Quoted, served: Quoted, digits: int) -> Quoted:
    """headline.json -> its document when it holds the rows of this draft's eval.json and serve_eval.json, else why not."""
    path = metrics / "headline.json"
    if not path.is_file():
        return f"Not measured yet: the headline stage writes `{path}` from eval.json and serve_eval.json (`dvc repro`)."
    if isinstance(engine, str) or isinstance(served, str):
        return f"Not quoted: `{path}` sums up eval.json and serve_eval.json, which do not both describe these weights yet."
    document = read_json(path)
    if document != headline_rows(metrics / "eval.json", metrics / "serve_eval.json", digits):
        return (f"Not quoted: `{path}` does not hold the numbers of eval.json and serve_eval.json on these weights "
                "(an older run, or other headline params); re-run the headline stage (`dvc repro`).")
    return document
