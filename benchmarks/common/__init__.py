"""What the benchmark scripts share (benchmarks/ and benchmarks/studies/), one module a concern, so that
each script is only its measurement; the tests import the parts they share with the scripts (pytest puts
benchmarks/ on the import path). Nothing in dominospec imports it.

- `cli`: the command line, params overrides, loading the target and the draft, the plain engine;
- `random_models`: random targets of named public shapes, tokenizers, HF model dirs;
- `random_head`: the Domino head with random weights and its rollout paths;
- `prompts`: prompt files, the draft study's pack, teacher-forced reply blocks;
- `timing`: medians, CUDA graph capture, interleaved runs, verify costs;
- `generate`: transformers' compiled static-cache `generate`;
- `train_loop`: the train stage's Lightning loop for a few steps;
- `record`: the environment of a result, JSON out;
- `http_load`: load on a running server.
"""
