"""Parameter-efficient fine-tuning: LoRA adapters on the TP layers, in PEFT's file format (docs/peft.md)."""
