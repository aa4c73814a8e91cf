"""The two imports SGLang 0.5.23 cannot satisfy on a CPU-only machine, stubbed for the SGLang-code test.

Only `sglang_view.py` (run in its own subprocess) installs these; nothing else in the project sees them.

- `torchvision`: SGLang's multimodal config code imports it at module level
  (`sglang/srt/multimodal/internvl_utils.py`: `torchvision.transforms`, `InterpolationMode`), and
  the import chain of `DFlashDraftModel` passes through it. The only torchvision wheel that fits
  SGLang's torch pin is built for CUDA torch. Image preprocessing is never used by a text draft.
- `vllm._custom_ops`: the RoPE constructor (`sglang/srt/layers/rotary_embedding`) imports it as a
  fallback rotary kernel on platforms without sgl-kernel; it is only called in the forward pass.

Why stubbing is safe here: the test exercises config parsing, `DFlashDraftModel.__init__`,
`load_weights` and `domino_greedy_rollout`, none of which call either library. Every attribute of
a stub is a placeholder whose use raises `StubUsed`, so if SGLang's loading or rollout code ever
called into one, the test would fail loudly instead of passing on a fake.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types

STUB_PACKAGE = "torchvision"  # the package and every submodule SGLang imports from it
STUB_MODULES = ("vllm", "vllm._custom_ops")  # exactly these


def stubbed(name: str) -> bool:
    """A module name -> whether the stubs answer its import."""
    return name == STUB_PACKAGE or name.startswith(STUB_PACKAGE + ".") or name in STUB_MODULES


class StubUsed(RuntimeError):
    """Raised when SGLang code actually uses a stubbed library (the stub would then be unsafe)."""


class _Placeholder:
    """Stands for any attribute of a stub: it may be imported, subclassed or compared, never used."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise StubUsed(f"{self._name} was called, but it is a stub (tests/sglang_code/sglang_stubs.py)")

    def __repr__(self) -> str:
        return f"<stub {self._name}>"


class _StubModule(types.ModuleType):
    """A package whose submodules and attributes are placeholders."""

    def __init__(self, name: str):
        super().__init__(name)
        self.__path__ = []  # a package, so `import name.sub` goes through the finder below
        self.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        self.__version__ = "0.0.0+stub"

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self.__name__}.{attr}")


class _StubFinder:
    """Meta-path finder that answers the stubbed imports (`stubbed`) with stub modules."""

    @staticmethod
    def find_spec(fullname, path=None, target=None):
        if stubbed(fullname):
            return importlib.machinery.ModuleSpec(fullname, _StubFinder, is_package=True)
        return None

    @staticmethod
    def create_module(spec):
        return _StubModule(spec.name)

    @staticmethod
    def exec_module(module):
        pass


def install() -> None:
    """Answer the stubbed imports with stubs in this process; call it before SGLang is imported."""
    for name in (STUB_PACKAGE, *STUB_MODULES):
        if name in sys.modules:
            raise RuntimeError(f"{name} is already imported; stubbing it now would mix real and fake modules")
    sys.meta_path.insert(0, _StubFinder())
