"""How the models run on this machine, chosen before any engine is built: linears packed once for oneDNN
(`packed`), grouped-query attention without repeated keys (`attention`), and the target prepared once
with both (`prepare`). The engine's draft path and the regenerate stage use the same kernels."""
