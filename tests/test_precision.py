"""`auto` in the dtype and precision params (dominospec.precision): bf16 only where it runs fast.

A CPU without native bf16 is emulated by capping ATen and oneDNN at AVX2 in a child process (the
cache of `bf16_is_fast` is per process): there `auto` must resolve to float32 / 32-true. Explicit
values pass through untouched, CUDA is bf16, and each stage and the engine use the resolved value.
Run: python -m pytest tests/test_precision.py -q
"""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dominospec.config import load_params
from dominospec.precision import bf16_is_fast, resolve_dtype, resolve_precision

REPO = Path(__file__).resolve().parents[1]
PROBE = "from dominospec.precision import *; print(resolve_dtype('auto', 'cpu'), resolve_precision('auto', 'cpu'))"


def resolved_in_child(**env: str) -> list[str]:
    """-> [dtype, precision] that `auto` resolves to in a fresh interpreter with `env` added."""
    out = subprocess.run([sys.executable, "-c", PROBE], env={**os.environ, **env}, capture_output=True, text=True,
                         check=True)
    return out.stdout.split()


@pytest.mark.parametrize("cap", [{"ATEN_CPU_CAPABILITY": "avx2"}, {"ONEDNN_MAX_CPU_ISA": "AVX2"}])
def test_a_cpu_capped_below_native_bf16_resolves_auto_to_fp32(cap):
    assert resolved_in_child(**cap) == ["float32", "32-true"]


def test_auto_follows_the_cpus_native_bf16():
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    uncapped = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")}
    out = subprocess.run([sys.executable, "-c", PROBE], env=uncapped, capture_output=True, text=True, check=True)
    assert out.stdout.split() == (["bfloat16", "bf16-mixed"] if native else ["float32", "32-true"])


def test_explicit_values_pass_through_and_cuda_is_bf16():
    assert [resolve_dtype(v, "cpu") for v in ("float32", "bfloat16", "float16", None)] == \
        ["float32", "bfloat16", "float16", None]
    assert resolve_precision("32-true", "cpu") == "32-true" and resolve_precision("bf16-true", "cpu") == "bf16-true"
    assert bf16_is_fast("cuda") and resolve_dtype("auto", "cuda") == "bfloat16"
    assert resolve_precision("auto", "gpu") == "bf16-mixed"
    assert not bf16_is_fast("mps")


def test_the_default_params_take_auto_and_a_bad_value_names_its_key(tmp_path):
    params = load_params(REPO / "params.yaml")
    assert (params.regenerate.dtype, params.cache.compute_dtype, params.train.precision, params.engine.draft_dtype) == \
        ("auto",) * 4
    bad = tmp_path / "params.yaml"
    bad.write_text((REPO / "params.yaml").read_text().replace("  draft_dtype: auto", "  draft_dtype: bf32", 1))
    with pytest.raises(Exception, match="draft_dtype"):
        load_params(bad)


def test_the_engine_drafts_in_the_resolved_dtype():
    from engine_helpers import tiny_draft, tiny_target

    from dominospec.engine.decoding import resolve
    from dominospec.target import DTYPES

    target = tiny_target()
    base = load_params(REPO / "params.yaml").engine
    options = dataclasses.replace(base, linear="torch", draft_dtype="auto", cuda_graphs="off", lean_target="off")
    decoding = resolve(target, tiny_draft(target), "domino", 3, options)
    assert decoding.draft_dtype == DTYPES[resolve_dtype("auto", target.device)]
