"""How the models run on this machine, chosen before any engine is built: linears packed once for oneDNN
(`packed`), grouped-query attention without repeated keys (`attention`), the target prepared once
with both (`prepare`), and transformers' KV cache the same on every release (`kv`). The engine and the
regenerate stage use them alike."""
