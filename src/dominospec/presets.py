"""`dominospec preset NAME`: write params/NAME.yaml's overrides into params.yaml, the file DVC tracks.

A preset holds only the keys that differ from the default params.yaml (config.read_params overlays
it). Applying one edits params.yaml's values in place with a round-trip YAML parser, so the file
keeps its layout and comments; an override's own end-of-line comment replaces the default's. The
first line records the preset (`# preset: NAME ...`), so a second, different preset is refused
rather than stacked on the first. Nothing is written unless the result loads (config.load_params),
and the write is atomic: a bad name, an unknown key or a wrong type leaves params.yaml as it was.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import yaml

from dominospec.config import PRESET_STAMP, PRESETS, load_params, read_params
from dominospec.errors import ParamsError
from dominospec.files import write_atomic


def preset_names(params: Path) -> list[str]:
    """params.yaml -> the names of the presets in the `params/` folder beside it, sorted."""
    return sorted(p.stem for p in (params.resolve().parent / PRESETS).glob("*.yaml"))


def apply_preset(name: str, params: str | Path = "params.yaml") -> list[str]:
    """Preset NAME -> params.yaml rewritten as default + preset (validated, then written atomically);
    returns the dotted keys whose values it changed (none when the preset is already applied)."""
    params = Path(params)
    if params.name != "params.yaml":
        raise ParamsError(f"{params}: a preset applies to a params.yaml, the file beside {PRESETS}/")
    preset = params.resolve().parent / PRESETS / f"{name}.yaml"
    if not preset.is_file():
        raise ParamsError(f"no preset '{name}': {PRESETS}/ holds {', '.join(preset_names(params)) or 'none'}")
    load_params(preset)  # every problem named here, before anything is written
    text = params.read_text(encoding="utf-8")
    stamp = PRESET_STAMP.match(text)
    body = text[text.index("\n") + 1:] if stamp else text
    rt = _round_trip()
    merged, over = rt.load(body), rt.load(preset.read_text(encoding="utf-8"))
    changed = _overlay_with_comments(merged, over, "")
    out = io.StringIO()
    rt.dump(merged, out)
    written = (f"# preset: {name}; written by `dominospec preset {name}` ({PRESETS}/{name}.yaml over the default; "
               f"`git checkout {params.name}` restores it)\n" + out.getvalue())
    if yaml.safe_load(written) != read_params(preset):  # what is written is what was validated
        raise RuntimeError(f"the round-trip writer changed a value of {PRESETS}/{name}.yaml")
    write_atomic(params, written.encode("utf-8"))
    return changed


def _overlay_with_comments(base: Any, over: Any, prefix: str) -> list[str]:
    """config.overlay on round-trip mappings, also moving each override's end-of-line comment; -> changed keys."""
    changed = []
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            changed += _overlay_with_comments(base[key], value, f"{prefix}{key}.")
            continue
        if base.get(key) != value:
            changed.append(f"{prefix}{key}")
        base[key] = value
        _move_eol_comment(base, over, key)
    return changed


def _move_eol_comment(base: Any, over: Any, key: str) -> None:
    """The override's end-of-line comment on `key`, if it has one, in place of the base's (the blank lines and
    comment lines the base's token carries after it are kept)."""
    comment = over.ca.items.get(key, [None] * 3)[2]
    line = comment.value.split("\n", 1)[0] if comment is not None else ""
    if not line.startswith("#"):
        return
    old = base.ca.items.get(key, [None] * 3)[2]
    if old is None:
        base.yaml_add_eol_comment(line, key, column=comment.column)
        return
    head = old.value.split("\n", 1)[0]
    old.value = line + old.value[len(head):]
    old.column = old.column if head.startswith("#") else comment.column


def _round_trip() -> Any:
    """A ruamel.yaml round-trip parser that writes params.yaml's style: `null`, 2-space indents, long lines."""
    from ruamel.yaml import YAML  # a dependency of dvc, and ours

    rt = YAML()
    rt.width = 4096
    rt.indent(mapping=2, sequence=4, offset=2)
    rt.representer.add_representer(type(None), lambda r, _: r.represent_scalar("tag:yaml.org,2002:null", "null"))
    return rt

