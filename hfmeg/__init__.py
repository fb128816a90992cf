"""hfmeg: Megatron-style parallel fine-tuning for Hugging Face LLaMA-family and GPT models."""

__version__ = "0.1.0"
