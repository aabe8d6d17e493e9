"""The multimodal inputs of one engine step, made in the runner's plan step before the model runs.

Image embeddings are computed once per request: in the first forward whose new tokens reach one of
its placeholders, by one encoder call (planned, then run) for every request of that step that needs
them. Once the prompt's last placeholder is computed, the embeddings are dropped (a preempted
request recomputes them).
"""

from __future__ import annotations

import torch

from ..models.base import MultimodalModel
from ..runtime.multimodal import MultimodalBatch


def build_multimodal_batch(model: MultimodalModel, scheduled, device: torch.device) -> MultimodalBatch | None:
    """The multimodal inputs of one step (``None`` when no scheduled sequence has images).

    ``scheduled``: ``(sequence, number of new tokens)`` pairs in batch order, before the step
    (``seq.num_computed`` is where each sequence's new tokens start). Runs the model's image encoder
    once for all sequences whose embeddings this step needs first.
    """
    if all(seq.multimodal is None for seq, _ in scheduled):
        return None
    todo = [
        seq.multimodal
        for seq, n in scheduled
        if seq.multimodal is not None
        and seq.multimodal.embeds is None
        and seq.multimodal.overlaps_images(seq.num_computed, seq.num_computed + n)
    ]
    if todo:
        pixel_values = torch.cat([data.pixel_values for data in todo]).to(device)  # [N, patch_dim]
        image_plan = model.plan_images([g for data in todo for g in data.grid])  # the encoder's host syncs
        embeds = model.encode_planned_images(pixel_values, image_plan)  # [U, H]
        for data, part in zip(todo, embeds.split([data.num_image_tokens for data in todo])):
            data.embeds = part

    positions, rows, parts = [], [], []
    offset = 0
    for seq, n in scheduled:
        first, last = seq.num_computed, seq.num_computed + n
        data = seq.multimodal
        if data is None:
            positions.append(torch.arange(first, last).expand(3, -1))  # [3, n]
            offset += n
            continue
        positions.append(data.positions_of(first, last))
        embed_start = 0
        for s, e in data.spans:
            lo, hi = max(first, s), min(last, e)
            if lo < hi:
                rows.append(torch.arange(offset + lo - first, offset + hi - first))
                parts.append(data.embeds[embed_start + lo - s : embed_start + hi - s])  # [hi - lo, H]
            embed_start += e - s
        if data.spans and last >= data.spans[-1][1]:
            data.embeds = None  # every placeholder is computed; `parts` keeps what this step uses
        offset += n
    return MultimodalBatch(
        positions=torch.cat(positions, dim=1).to(device),  # [3, T]
        embeds=torch.cat(parts) if parts else None,  # [M, H]
        embed_rows=torch.cat(rows).to(device) if rows else None,  # [M]
    )
