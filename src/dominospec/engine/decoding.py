"""Resolve once: (mode, num_draft, engine params, target, draft) -> `Decoding`, what one engine decodes by.

Every later part of the engine reads the frozen `Decoding`, never the mode string nor `EngineParams`
(tests/test_layout.py checks it): the mode is decoded here, once, into what it means.

    mode        draft   head   shape
    ar          -       -      -          a plain target step a round
    ngram       -       -      chain      the prompt lookup is the draft
    dflash      yes     off    chain      the draft's base logits (head off)
    domino      yes     on     engine.tree.shape (best_first: DominoTree greedy, the head's chain sampled;
                               chain: the head's chain)
    dominotree  yes     on     best_first, whatever engine.tree.shape says, greedy and sampled

Sampled, `domino` drafts its chain (`sampled_chain`; docs/design.md §1.6). `name` is the resolved mode
(`domino` on best_first reads `dominotree`), a label nothing branches on. Every check happens here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Union

import torch

from dominospec.config import EngineParams, TreeParams
from dominospec.draft import check_draft_matches
from dominospec.engine.verify_shape import MAX_TREE_ROWS
from dominospec.errors import UserError
from dominospec.models.domino import DFlashDraftModel
from dominospec.models.lean import unsupported
from dominospec.precision import resolve_dtype
from dominospec.target import DTYPES, Target

MODES = ("ar", "ngram", "dflash", "domino", "dominotree")
MAX_TREE_NODES = 256  # a budget's verify, 1 + 256 nodes + a lookup chain, fits the lean decoder's rows


@dataclass(frozen=True)
class Lookup:
    """Prompt lookups (engine.ngram): k_max, the most tokens a round verifies (0: none); the suffix
    n-grams looked up, shortest and longest; fork: verified beside the draft (greedy), not instead."""

    k_max: int = 0
    ngram_min: int = 1
    ngram_max: int = 1
    fork: bool = False


@dataclass(frozen=True)
class Decoding:
    """One engine's decoding, resolved (module docstring)."""

    name: str  # the resolved mode, a label
    drafting: bool  # a draft model proposes
    head: bool  # the Domino head corrects it
    tree: bool  # DominoTree's best-first tree of `nodes` nodes, each offering `children` (else a chain)
    sampled_chain: bool  # the tree's sampled rounds draft the head's chain instead
    nodes: int
    children: int
    block_size: int  # B (ngram: its lookup + 1; ar: 1)
    k_max: int  # the drafts a round verifies at most
    auto: bool  # auto-K: K chosen every round
    lookup: Lookup
    cut: float  # the chain's confidence cut (0: off)
    pool: int  # the candidate pool M (0: full vocabulary)
    window: int  # auto-K's acceptance window
    kernels: bool  # the head's Triton kernels (else torch ops)
    draft_dtype: torch.dtype
    packed: bool  # the draft path's linears packed for oneDNN
    static: bool  # static caches of `capacity` rows
    graphs: bool  # CUDA graphs replayed on them
    capacity: int
    lean: bool  # the target (and the draft's backbone) on the lean decoder

    @property
    def max_verify(self) -> int:
        """The most tokens one round verifies: a chain of K or a tree's nodes, a lookup, or both (forking)."""
        own = self.nodes if self.tree else self.k_max
        return own + self.lookup.k_max if self.lookup.fork else max(own, self.lookup.k_max)

    @property
    def max_rows(self) -> int:
        """The widest forward after the prompt: the verify of x_start and a round's proposal, or the draft block."""
        return max(self.block_size, self.max_verify) + 1

    @property
    def head_chain(self) -> bool:
        """The Domino head drafts chains: no tree, or a tree's sampled rounds."""
        return self.head and (not self.tree or self.sampled_chain)


def resolve(target: Target, draft: Optional[DFlashDraftModel], mode: str, num_draft: Union[int, str, None],
            params: Optional[EngineParams]) -> Decoding:
    """What an engine of `mode` decodes by (module docstring); UserError names the first thing that does not fit."""
    if mode not in MODES:
        raise UserError(f"unknown decoding mode {mode!r}: expected one of {list(MODES)}")
    if params is None:
        raise UserError("SpecEngine needs the engine's params (params.yaml `engine:`, config.EngineParams)")
    if params.linear not in ("packed", "torch"):
        raise UserError(f"engine.linear: {params.linear} is resolved by runtime.prepare.prepare_target(), "
                        "which times the target; pass dataclasses.replace(params, linear=its choice)")
    static, graphs = static_caches(params)
    drafting, head = mode in ("dflash", "domino", "dominotree"), mode in ("domino", "dominotree")
    tree = mode == "dominotree" or (mode == "domino" and params.tree.shape == "best_first")
    kernels = False
    dtype = target.embed_tokens.weight.dtype
    if drafting:
        block_size = check_draft(draft, target, mode, head)
        kernels = head_kernels(params.head_kernel, target.device)
        dtype = DTYPES[resolve_dtype(params.draft_dtype, target.device)] if params.draft_dtype else dtype
    else:
        block_size = params.ngram_num_draft + 1 if mode == "ngram" else 1
    if tree:
        check_tree(params.tree)
    auto = num_draft == "auto"
    k_max = 0 if mode == "ar" else checked_k_max(num_draft, auto, block_size)
    lookup_k = k_max if mode == "ngram" else (params.ngram_num_draft if params.ngram_assist and drafting else 0)
    lookup = Lookup(lookup_k, params.ngram_min, params.ngram_max,
                    fork=params.ngram_fork and lookup_k > 0 and mode != "ngram")
    decoding = Decoding(name="dominotree" if tree else mode, drafting=drafting, head=head, tree=tree,
                        sampled_chain=tree and mode == "domino",
                        nodes=params.tree.nodes if tree else 0, children=params.tree.children, block_size=block_size,
                        k_max=k_max, auto=auto, lookup=lookup, cut=params.confidence_cut, pool=params.candidate_pool,
                        window=params.acceptance_window, kernels=kernels, draft_dtype=dtype,
                        packed=params.linear == "packed", static=static, graphs=graphs,
                        capacity=params.graph_capacity, lean=False)
    lean = lean_target(params.lean_target, decoding, target)
    return Decoding(**{**decoding.__dict__, "lean": lean}) if lean else decoding


def static_caches(cfg: EngineParams) -> tuple[bool, bool]:
    """engine.cuda_graphs -> (static caches, CUDA graphs replayed on them) on this machine: `on` both
    (CUDA only), `auto` both where CUDA is, `static` the caches with eager forwards (any device),
    `off` neither."""
    if cfg.graph_capacity < 16:
        raise UserError(f"engine.graph_capacity must be >= 16 rows, got {cfg.graph_capacity}")
    if cfg.cuda_graphs == "on" and not torch.cuda.is_available():
        raise UserError("engine.cuda_graphs: on needs a CUDA GPU; set engine.cuda_graphs: auto or off on this machine")
    if cfg.cuda_graphs == "static":
        return True, False
    graphs = cfg.cuda_graphs == "on" or (cfg.cuda_graphs == "auto" and torch.cuda.is_available())
    return graphs, graphs


def check_draft(draft: Optional[DFlashDraftModel], target: Target, mode: str, head: bool) -> int:
    """The draft of a draft mode, checked against the target and the mode -> its block size B."""
    if draft is None:
        raise UserError(f"mode {mode!r} needs a draft model")
    check_draft_matches(draft.config, target)
    if head and not draft.config.use_domino_head:
        raise UserError(f"mode {mode!r} needs a draft trained with the Domino head "
                        "(config.use_domino_head is false)")
    resolved = torch.empty(0, device=target.device).device  # "cuda" -> "cuda:0"
    if draft.fc.weight.device != resolved:
        raise UserError(f"draft is on {draft.fc.weight.device}, target on {target.device}: move it")
    block_size = int(draft.config.block_size)
    if block_size < 2:
        raise UserError(f"draft block_size must be >= 2, got {block_size}")
    return block_size


def head_kernels(choice: str, device: torch.device) -> bool:
    """engine.head_kernel -> whether the head runs on the Triton kernels: `triton` (checked: CUDA, or
    TRITON_INTERPRET=1 on CPU, and triton installed), `auto` on a CUDA draft with triton installed
    (never on CPU, where the kernels only run interpreted, for tests), `torch` never."""
    if choice == "torch" or (choice == "auto" and device.type != "cuda"):
        return False
    if choice == "triton" and not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
        raise UserError("engine.head_kernel: triton needs a CUDA GPU (or TRITON_INTERPRET=1 to run the kernels "
                        "slowly on CPU); set engine.head_kernel: torch on this machine")
    try:
        import triton  # noqa: F401
    except ImportError:
        if choice == "triton":
            raise UserError("engine.head_kernel: triton, but the triton package is not installed") from None
        return False
    return True


def check_tree(tree: TreeParams) -> None:
    """engine.tree's nodes and children within their limits."""
    if tree.nodes < 1 or tree.children < 1:
        raise UserError(f"engine.tree.nodes and engine.tree.children must be >= 1, got {tree.nodes} and {tree.children}")
    if tree.nodes > MAX_TREE_NODES:
        raise UserError(f"engine.tree.nodes is at most {MAX_TREE_NODES} (a verify of 1 + nodes + lookup "
                        f"rows), got {tree.nodes}")


def checked_k_max(num_draft: Union[int, str, None], auto: bool, limit: int) -> int:
    """K_max: `num_draft`, or B - 1 (ngram: ngram_num_draft) when None or auto."""
    if num_draft is not None and not auto and not (isinstance(num_draft, int) and 1 <= num_draft <= limit):
        raise UserError(f"num_draft must be 'auto' or lie in 1..{limit}, got {num_draft!r}")
    return limit - 1 if num_draft is None or auto else num_draft


def lean_target(choice: str, decoding: Decoding, target: Target) -> bool:
    """engine.lean_target -> whether the target runs on the lean decoder (static caches only): `on`
    insists (an error names what does not fit), `auto` takes it on CUDA where it fits, `off` never."""
    if choice not in ("on", "off", "auto"):
        raise UserError(f"engine.lean_target must be on, off or auto, got {choice!r}")
    if choice == "off" or not decoding.static:
        return False
    rows = decoding.max_rows
    problem = (unsupported(target.model) or (rows > MAX_TREE_ROWS and
                                             f"its widest round verifies {rows} rows, over {MAX_TREE_ROWS}")
               or (decoding.packed and "the draft path's linears are packed for oneDNN (engine.linear)"))
    if choice == "auto" and (problem or target.device.type != "cuda"):
        return False
    if problem:
        raise UserError(f"engine.lean_target: on, but this engine cannot use it: {problem} "
                        "(lower engine.tree.nodes / ngram_num_draft, or set lean_target: auto)")
    return True
