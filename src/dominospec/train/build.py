"""Assemble what the train stage needs: draft config from params + target, module, data module.

The draft's shapes come from `params.draft` (null = as the target); the feature layers and
the mask token come from the cache manifest (cache mode) or from the cache params and the
prepared data's meta.json (online mode), so the draft always matches the data it learns from.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from dominospec.errors import UserError
from dominospec.config import DraftParams, Params
from dominospec.models.domino import DFlashDraftModel, DominoDraftConfig
from dominospec.target import Target, load_target


@dataclass
class TrainingSetup:
    """The pieces `train()` hands to Lightning."""

    module: Any  # DraftLitModule
    datamodule: Any  # DraftDataModule
    data_fingerprint: str
    target: Target


def rope_theta(target_config: Any) -> float:
    """RoPE base of a target config (transformers 4.x `rope_theta`, 5.x `rope_parameters`)."""
    params = getattr(target_config, "rope_parameters", None) or {}
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta if theta is not None else getattr(target_config, "rope_theta", 10000.0))


def draft_config(draft: DraftParams, target: Target, layer_ids: list[int], mask_token_id: int) -> DominoDraftConfig:
    """params.draft + the loaded target + feature layers + MASK id -> DominoDraftConfig."""
    tc = target.model.config
    heads = draft.num_attention_heads or tc.num_attention_heads
    head_dim = draft.head_dim or getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    return DominoDraftConfig(
        vocab_size=target.identity.vocab_size,
        hidden_size=target.hidden_size,
        intermediate_size=draft.intermediate_size or tc.intermediate_size,
        num_hidden_layers=draft.num_layers,
        num_attention_heads=heads,
        num_key_value_heads=draft.num_key_value_heads or getattr(tc, "num_key_value_heads", heads),
        head_dim=head_dim,
        max_position_embeddings=getattr(tc, "max_position_embeddings", 32768),
        rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-6)),
        rope_theta=rope_theta(tc),
        block_size=draft.block_size,
        num_target_layers=target.num_layers,
        emb_dim=draft.emb_dim,
        dflash_config={
            "mask_token_id": int(mask_token_id),
            "target_layer_ids": list(layer_ids),
            "projector_type": "domino",
            "pure_draft_prefix_len": 1,
            "emb_dim": draft.emb_dim,
            "gru_hidden_dim": draft.gru_hidden_dim,
            "shift_label": True,
        },
        use_domino_head=draft.use_domino_head,
        target=target.identity.as_dict(),
    )


def _feature_source(params: Params, target: Target) -> tuple[list[int], int, str]:
    """-> (layer ids, mask token id, data fingerprint) from the cache or the prepared data."""
    if params.train.features == "cache":
        from dominospec.cache.format import read_manifest

        manifest = read_manifest(Path(params.paths.cache))
        if not target.identity.same_model(manifest.target):
            raise UserError(
                f"the cache at {params.paths.cache} was made from target {manifest.target.get('name')} "
                f"({manifest.target.get('sha256') or manifest.target.get('revision')}), not the configured "
                f"{target.identity.name}: re-run the cache stage"
            )
        return list(manifest.layer_ids), int(manifest.mask_token_id), manifest.fingerprint
    from dominospec.cache.features import resolve_layer_ids

    meta_path = Path(params.paths.regenerated) / "meta.json"
    if not meta_path.is_file():
        raise UserError(f"online features need the prepared data: {meta_path} is missing (run prepare/regenerate)")
    meta = json.loads(meta_path.read_text())
    fingerprint = hashlib.sha256(meta_path.read_bytes()).hexdigest()[:16]
    return resolve_layer_ids(params.cache, target.num_layers), int(meta["mask_token_id"]), fingerprint


def build_training(params: Params, train_limit: Optional[int] = None) -> TrainingSetup:
    """Params -> TrainingSetup (loads the target once; its weights stay frozen)."""
    from dominospec.train.datamodule import DraftDataModule
    from dominospec.train.init import init_from_target
    from dominospec.train.module import DraftLitModule

    # On CPU: Lightning moves the module's frozen buffers to each rank's device, and the online
    # target follows the module (loading it straight to "cuda" would put every rank on GPU 0).
    target = load_target(params.target, device=torch.device("cpu"))
    layer_ids, mask_token_id, fingerprint = _feature_source(params, target)
    config = draft_config(params.draft, target, layer_ids, mask_token_id)
    draft = DFlashDraftModel(config)
    hp = params.train
    if hp.loss in ("kd", "tv") and hp.features != "online":
        raise UserError(f"train.loss: {hp.loss} distils the target's logits, which only online features compute: "
                        "set train.features: online (or train.loss: ce)")
    if not 0.0 <= hp.tv_mix <= 1.0 or hp.tv_temperature <= 0:
        raise UserError(f"train.tv_mix must lie in [0, 1] and train.tv_temperature be > 0, got {hp.tv_mix} and "
                        f"{hp.tv_temperature}")
    if hp.val_walk_temperature is not None and hp.val_walk_temperature <= 0:
        raise UserError(f"train.val_walk_temperature must be > 0 or null (the greedy walk always runs), "
                        f"got {hp.val_walk_temperature}")
    if hp.max_minutes is not None and hp.max_minutes <= 0:
        raise UserError(f"train.max_minutes must be > 0 or null, got {hp.max_minutes}")
    if hp.checkpoint_minutes is not None and hp.checkpoint_minutes <= 0:
        raise UserError(f"train.checkpoint_minutes must be > 0 or null, got {hp.checkpoint_minutes}")
    if any(m <= 0 for m in hp.walk_minutes) or list(hp.walk_minutes) != sorted(set(hp.walk_minutes)):
        raise UserError(f"train.walk_minutes must be increasing minutes > 0, got {list(hp.walk_minutes)}")
    if params.train.labels == "target" and params.train.loss_vocab == "data":
        raise UserError("train.loss_vocab: data spans the data's own assistant tokens, but train.labels: target "
                        "supervises the target's greedy tokens: set train.loss_vocab: full (or train.labels: data)")
    if params.train.loss_vocab == "sampled" and params.train.loss in ("kd", "tv"):
        raise UserError(f"train.loss_vocab: sampled estimates the softmax of hard labels, but train.loss: {hp.loss} distils "
                        "the target's whole distribution: set train.loss: ce (or train.loss_vocab: full)")
    if params.train.val_walk_tokens is not None and params.train.val_walk_tokens < 2:
        raise UserError(f"train.val_walk_tokens must be >= 2 (a round needs a reply of two tokens) or null, "
                        f"got {params.train.val_walk_tokens}")
    if params.train.loss_negatives < 1:
        raise UserError(f"train.loss_negatives must be >= 1, got {params.train.loss_negatives}")
    if params.train.init_from_target:
        init_from_target(draft, target.model, layer_ids)
    lm_head = target.lm_head
    if getattr(lm_head, "bias", None) is not None:
        raise UserError("targets whose LM head has a bias are not supported")
    datamodule = DraftDataModule(
        features=params.train.features,
        cache_dir=Path(params.paths.cache),
        data_dir=Path(params.paths.regenerated),
        batch_size=params.train.batch_size,
        val_max_sequences=params.train.val_max_sequences,
        num_workers=params.train.num_workers,
        seed=params.train.seed,
        train_limit=train_limit,
        group_by_length=params.train.group_by_length,
    )
    module = DraftLitModule(
        draft,
        embed_weight=target.embed_tokens.weight,
        lm_head_weight=lm_head.weight,
        train=params.train,
        # online features, or a sampled val walk (the target's logits on val): the frozen target rides along
        online_target=target.model if hp.features == "online" or hp.val_walk_temperature is not None else None,
        layer_ids=layer_ids,
        loss_vocab=loss_vocab(params, datamodule, draft),
    )
    return TrainingSetup(module=module, datamodule=datamodule, data_fingerprint=fingerprint, target=target)


def loss_vocab(params: Params, datamodule: Any, draft: DFlashDraftModel) -> Optional[torch.Tensor]:
    """train.loss_vocab: data -> ids [V'] of every token the train split supervises (None: full).

    The rows of W2 outside it would never get a gradient, so they start (and stay) zero: the
    exported head adds no correction to a token it never learnt about, instead of init noise."""
    if params.train.loss_vocab in ("full", "sampled"):  # sampled: drawn per step (train/sampled_vocab.py)
        return None
    from dominospec.train.objective import loss_vocabulary

    datamodule.setup()
    vocab = loss_vocabulary(datamodule.train_set)
    if vocab.numel() == 0:
        raise UserError("train.loss_vocab: data found no supervised token in the train split")
    if draft.config.use_domino_head:
        outside = torch.ones(draft.config.vocab_size, dtype=torch.bool)
        outside[vocab] = False
        with torch.no_grad():
            draft.embed_proj[2].weight[outside] = 0.0
    return vocab
