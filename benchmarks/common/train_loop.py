"""The train stage's Lightning loop for a few steps (`train_steps`: blocks/s, peak memory) on random
sequences (`Sequences`), timed by `StepClock`.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

import torch

from common.cli import new_draft

class Sequences(torch.utils.data.Dataset):
    """Random token sequences, prompt 40..600 + reply 60..256 tokens (a first turn and a reply of the
    presets' length), loss mask on the reply: what a train step costs does not depend on the tokens."""

    def __init__(self, count: int, vocab: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for _ in range(count):
            prompt = int(torch.randint(40, 600, (1,), generator=g))
            reply = int(torch.randint(60, 257, (1,), generator=g))
            ids = torch.randint(0, vocab, (prompt + reply,), generator=g)
            mask = torch.zeros(prompt + reply, dtype=torch.bool)
            mask[prompt:] = True
            self.items.append({"input_ids": ids, "loss_mask": mask})

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        return self.items[i]


class StepClock:
    """Lightning callback: wall time of every training step after the first `skip`, device-synced."""

    def __init__(self, skip: int):
        import lightning as L

        clock = self

        class _Callback(L.Callback):
            def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
                torch.cuda.synchronize() if torch.cuda.is_available() else None
                clock.times.append(time.perf_counter())

        self.skip, self.times, self.callback = skip, [], _Callback()

    def seconds_per_step(self) -> float:
        t = self.times[self.skip:]
        return (t[-1] - t[0]) / max(1, len(t) - 1)


def blocks_per_step(data: Any, batches: list[list[int]], num_anchors: int, block_size: int, skip: int) -> float:
    """Mean blocks trained by the timed steps (those after step `skip`: the intervals StepClock times):
    min(num_anchors, valid anchors) a sequence, since a reply shorter than its anchors trains fewer
    than num_anchors. Counted after the run, from the sampler's batches (a function of the step)."""
    from dominospec.train.objective import valid_anchors

    per = [sum(min(num_anchors, valid_anchors(data[i]["loss_mask"], block_size).numel()) for i in batch)
           for batch in batches]
    timed = per[skip + 1:] or per[-1:]
    return sum(timed) / len(timed)


def train_steps(params: Any, target: Any, steps: int, skip: int, collate: Optional[Callable] = None,
                data: Optional[Any] = None) -> dict:
    """The train stage's own loop (`DraftLitModule` under `lightning.Trainer`: params.train's precision,
    AdamW, clipping; online target features) for `steps` steps of params.train.batch_size `Sequences`
    (or `data`) -> {step_ms, blocks_per_step (trained: `blocks_per_step`), blocks_per_s, steps, wall_s, peak_gib, module}; the first
    `skip` steps untimed. `collate`: the batch builder (default: the stage's)."""
    import lightning as L

    from dominospec.train.datamodule import StepBatchSampler
    from dominospec.train.datamodule import collate as stage_collate
    from dominospec.precision import resolve_precision
    from dominospec.train.module import DraftLitModule

    draft = new_draft(params, target)
    module = DraftLitModule(draft, target.embed_tokens.weight, target.lm_head.weight, params.train,
                            online_target=target.model, layer_ids=list(draft.config.target_layer_ids))
    data = data if data is not None else Sequences(512, target.identity.vocab_size)
    clock = StepClock(skip)
    trainer = L.Trainer(max_steps=steps, max_epochs=1, accelerator="auto", devices=1,
                        precision=resolve_precision(params.train.precision, params.train.accelerator), gradient_clip_val=params.train.grad_clip,
                        log_every_n_steps=params.train.log_every_steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, callbacks=[clock.callback],
                        limit_val_batches=0, num_sanity_val_steps=0, enable_model_summary=False)
    start = time.perf_counter()
    sampler = StepBatchSampler(len(data), params.train.batch_size, 0, 0, steps,
                               lengths=[len(it["input_ids"]) for it in data.items] if params.train.group_by_length else None)
    loader = torch.utils.data.DataLoader(data, collate_fn=collate or stage_collate, batch_sampler=sampler)
    trainer.fit(module, train_dataloaders=loader)
    wall = time.perf_counter() - start
    step_s = clock.seconds_per_step()
    blocks = blocks_per_step(data, list(sampler), params.train.num_anchors, params.draft.block_size, skip)
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
    return {"step_ms": step_s * 1e3, "blocks_per_step": blocks, "blocks_per_s": blocks / step_s,
            "steps": steps, "wall_s": wall, "peak_gib": peak, "module": module}
