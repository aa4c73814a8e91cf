"""Export: a trained draft -> the Hugging Face directory stock SGLang serves (DFLASH + Domino) and ONNX graphs."""

from dominospec.export.contract import FORMAT_VERSION, check_config, check_export_dir, expected_tensors

__all__ = ["FORMAT_VERSION", "check_config", "check_export_dir", "expected_tensors"]
