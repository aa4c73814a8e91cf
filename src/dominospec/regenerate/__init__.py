"""The regenerate stage: the target's own replies to the prepared conversations, decoded in slot batches.

stage (the DVC stage: chunks, journal, atomic write) -> replies (conversations rewritten turn by
turn) -> decoder (one batched decoding step for every slot, loop detection) -> kv_batch (the slots'
KV caches in groups, and the attention over them); journal (the resumable record of finished chunks),
loops (repeated n-grams).
"""
